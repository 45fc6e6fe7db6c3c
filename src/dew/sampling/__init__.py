from dew.sampling.text import Generation, Sampling, generate  # text generation (jax/numpy only)
from dew.sampling.guidance import CFG  # diffusion: classifier-free guidance
from dew.sampling.sample import sample  # diffusion: run a solver over a sigma grid
from dew.sampling.solvers import (  # diffusion solvers, one signature
    DDIM, DDPM, DEIS, KDPM2, LCM, LMS, PNDM, RK4, TCD, DPMSolver, DPMSolverPP2M, DPMSolverPP2S,
    DPMSolverPPSDE, EDMStochastic, Euler, EulerAncestral, Heun, MultiStepDPM, Solver, UniPC)
