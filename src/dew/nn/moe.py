"""A mixture-of-experts feed-forward layer: a router, SwiGLU experts, an optional shared expert.

    probs   = softmax(x @ gate + gate_bias)               router scores over E experts, float32
    w, e    = top_k(probs)                                each row's k experts and their scores
    w       = w / sum(w)   (normalize_top_k)              Mixtral always, Qwen3-MoE by norm_topk_prob
    y       = routed_scale * sum_j w_j * expert_{e_j}(x)  expert(x) = down(silu(gate(x)) * up(x))
    y      += sigmoid(x @ shared_expert_gate) * shared_expert(x)     (Qwen's shared expert)

DeepSeek-V3 (arXiv:2412.19437, section 2.1.2) scores by ``sigmoid(x @ gate)`` instead and chooses
experts by the scores plus a per-expert bias (``score_bias``, the auxiliary-loss-free balancing
bias): the bias only selects, the chosen experts are weighted by their unbiased scores. With
``groups`` > 1 the experts are split into equal groups, each group is rated by the sum of its two
best biased scores, and only the experts of the ``group_top_k`` best groups can be chosen. The bias
is not a parameter: it lives in the ``balance`` collection, no gradient reaches it and no optimizer
holds it, and the auxiliary-loss-free balancing rule moves it after each step
(`balanced_score_bias`: ``bias_e += rate * sign(mean_load - load_e)``), so an overloaded expert
is chosen less often.

GPT-OSS's experts differ in three ways, each a setting: a bias on the router (``router_bias``) and
on every expert projection (``expert_bias``); the clamped SwiGLU (``activation="clamped_swiglu"``),
``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``; and the
gate and up kernels fused into one ``gate_up_proj`` whose columns alternate gate, up, gate, up
(``gate_up="interleaved"``). Its router takes the softmax of the k largest logits, which is the
renormalized top-k of the full softmax (``normalize_top_k=True``).

``dispatch="global"`` sorts the ``rows * k`` (row, expert) assignments by expert and runs each
projection as one grouped matrix product over the sorted rows, so no assignment is dropped and no
capacity is set. The grouped product is `jax.lax.ragged_dot` (``grouped="ragged_dot"``); as
``grouped="blocks"``, a batched product over fixed-size blocks of rows, each group padded to whole
blocks and each block multiplied by its expert's kernel; or, as ``grouped="padded"``, a batched
product over ``[E, C, width]``, every group padded to one capacity C, the smallest of a few that
holds the largest group (`capacities`), or, when the largest group is past 1.5 even shares, the
fewest blocks of a few counts that hold every group (`block_counts`); a switch over these layouts
keeps shapes static. XLA:CPU computes
``ragged_dot`` as a dense product masked to the groups, E times the work, so ``grouped="auto"``
takes ``ragged_dot`` off the CPU and on it ``padded`` from `MIN_PADDED_SHARE` assignments per
expert (training batches), ``blocks`` below (decoding). All compute the same layer. Dispatches are
methods named ``_dispatch_<name>`` taking the same arguments.

``dispatch="exchange"`` is expert parallelism (`dew.nn.expert_parallel`): in a training step on a
mesh with an ``expert`` axis of ``s > 1`` devices, each device holds ``E / s`` experts and its own
rows, sends each (row, expert) assignment to the device holding the expert with an all-to-all,
runs its experts over what it received (the same grouped products) and sends the results back.
Under ``global`` on such a mesh every device runs every expert over its rows, so the sharded
experts' parameters are gathered to every device. The exchange moves rows instead, through
buffers of a fixed capacity per (device, expert shard): by default as large as a device can ever
send one shard, so it computes what ``global`` does; a ``capacity_factor`` shrinks them and drops
(and counts, as the ``dropped`` router metric) the assignments past a full buffer. Outside such a
step (one device, generation) ``exchange`` computes as ``global``.

While applied with ``mutable=["router"]`` (as `LMObjective` does), each layer records its routing
statistics in the ``router`` collection; `router_metrics` turns every layer's record into the
load-balancing loss of transformers' Mixtral and Qwen-MoE models (Switch Transformer, Fedus et al.
2021, eq. 4-6, pooled over layers), the router z-loss (ST-MoE, Zoph et al. 2022, eq. 5) and the
tokens each expert received (and, under ``exchange``, the assignments dropped). Applied without it
(generation), nothing is recorded.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from dew.checks import count
from dew.nn import expert_parallel

INIT_STD = 0.02
ROUTER_COLLECTION = "router"
BALANCE_COLLECTION = "balance"  # the balancing bias, moved by a rule rather than by the optimizer
SCORES = ("softmax", "sigmoid")
GROUP_RATING_EXPERTS = 2  # a group is rated by the sum of its best two biased scores (DeepSeek-V3)
DISPATCHES = ("global", "exchange")
GROUPED_PRODUCTS = ("auto", "ragged_dot", "blocks", "padded")
MAX_BLOCK = 64  # rows per block of the blocked grouped product
CAPACITY_STEPS = (1.25, 1.5)  # the padded product's capacities, in even shares
MIN_PADDED_SHARE = 32  # "auto" pads by expert on a CPU from this many assignments per expert
ACTIVATIONS = ("swiglu", "clamped_swiglu")
GATE_UP_LAYOUTS = ("separate", "interleaved")


def _init(axes, std=INIT_STD):
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


def _zeros(axes):
    return nn.with_logical_partitioning(nn.initializers.zeros, axes)


class Mixture(nn.Module):
    """A routed mixture of SwiGLU experts for rows ``[..., width]``; returns the same shape.

    Attributes:
      num_experts: routed experts (E).
      top_k: experts each row is sent to (k <= E).
      expert_features: each expert's SwiGLU hidden width.
      num_layers: the model's depth, for GPT-2's scaled init of the output projections.
      score: how router logits become scores ("softmax", or DeepSeek's "sigmoid").
      score_bias: a per-expert bias (``score_bias`` in the ``balance`` collection) added to the
        scores to choose the experts but not to weight them (DeepSeek's e_score_correction_bias).
        No gradient reaches it; `balanced_score_bias` moves it.
      groups: split the experts into this many equal groups (DeepSeek's n_group).
      group_top_k: choose experts only from this many best groups (DeepSeek's topk_group).
      normalize_top_k: divide the k chosen scores by their sum (Mixtral; Qwen's norm_topk_prob).
      routed_scale: a factor on the routed experts' sum (DeepSeek's routed_scaling_factor).
      shared_expert_features: hidden width of an expert every row goes through (None: none).
      shared_expert_gate: scale the shared expert by ``sigmoid(x @ shared_expert_gate)`` (Qwen).
      router_bias: a bias on the router's logits (GPT-OSS).
      expert_bias: biases on each expert's gate, up and down projections (GPT-OSS).
      activation: "swiglu" (``silu(gate) * up``) or GPT-OSS's "clamped_swiglu" (`clamped_swiglu`
        with ``swiglu_alpha`` and ``swiglu_limit``).
      gate_up: the routed experts' parameters: "separate" gate_proj and up_proj kernels, or
        "interleaved", one gate_up_proj whose even columns are the gate and odd ones the up (GPT-OSS).
      dispatch: how rows reach their experts: "global", or "exchange" (an all-to-all over the
        ``expert`` mesh axis in a step that splits it; see the module docstring).
      capacity_factor: with ``exchange``, the send buffers' slots per (device, expert shard) as a
        multiple of an even share, ``rows * top_k / shards``; None: enough that nothing is dropped.
      grouped: the grouped matrix product of the global dispatch ("auto", "ragged_dot", "blocks",
        "padded"); it never changes the result or the parameters.
    """

    num_experts: int
    top_k: int
    expert_features: int
    num_layers: int = 1
    score: str = "softmax"
    score_bias: bool = False
    groups: int = 1
    group_top_k: int | None = None
    normalize_top_k: bool = False
    routed_scale: float = 1.0
    shared_expert_features: int | None = None
    shared_expert_gate: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    gate_up: str = "separate"
    dispatch: str = "global"
    capacity_factor: float | None = None
    grouped: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        count(self.num_experts, "Mixture.num_experts")
        count(self.top_k, "Mixture.top_k")
        count(self.expert_features, "Mixture.expert_features")
        count(self.shared_expert_features, "Mixture.shared_expert_features", optional=True)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"Mixture.top_k={self.top_k} is larger than num_experts={self.num_experts}; each row "
                "is routed to top_k distinct experts, so choose top_k <= num_experts"
            )
        count(self.groups, "Mixture.groups")
        count(self.group_top_k, "Mixture.group_top_k", optional=True)
        if self.num_experts % self.groups:
            raise ValueError(
                f"Mixture.groups={self.groups} does not divide num_experts={self.num_experts}; the experts "
                "are split into equal groups, so choose a divisor"
            )
        if self.groups > 1 and self.num_experts // self.groups < GROUP_RATING_EXPERTS:
            raise ValueError(
                f"Mixture.groups={self.groups} leaves {self.num_experts // self.groups} expert(s) per group; a "
                f"group is rated by its best {GROUP_RATING_EXPERTS}, so use at most "
                f"{self.num_experts // GROUP_RATING_EXPERTS} groups"
            )
        if self.group_top_k is not None and self.group_top_k > self.groups:
            raise ValueError(f"Mixture.group_top_k={self.group_top_k} is larger than groups={self.groups}")
        if self.group_top_k is not None and self.group_top_k * (self.num_experts // self.groups) < self.top_k:
            raise ValueError(
                f"Mixture.group_top_k={self.group_top_k} groups of {self.num_experts // self.groups} experts hold "
                f"fewer than top_k={self.top_k} experts; raise group_top_k or lower top_k"
            )
        if self.score not in SCORES:
            raise ValueError(f"Mixture.score={self.score!r} is not implemented; supported scores: {SCORES}")
        if self.dispatch not in DISPATCHES:
            raise ValueError(
                f"Mixture.dispatch={self.dispatch!r} is not implemented; supported dispatches: {DISPATCHES}"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"Mixture.capacity_factor must be positive (or None: nothing dropped), got {self.capacity_factor!r}"
            )
        if self.capacity_factor is not None and self.dispatch != "exchange":
            raise ValueError(
                f"Mixture.capacity_factor={self.capacity_factor} sizes the buffers of dispatch='exchange', but "
                f"dispatch={self.dispatch!r} drops nothing and has no capacity; set dispatch='exchange' or "
                "leave it None"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"Mixture.activation={self.activation!r} is not one of {ACTIVATIONS}")
        if self.gate_up not in GATE_UP_LAYOUTS:
            raise ValueError(f"Mixture.gate_up={self.gate_up!r} is not one of {GATE_UP_LAYOUTS}")
        if not self.swiglu_limit > 0:
            raise ValueError(f"Mixture.swiglu_limit must be positive, got {self.swiglu_limit!r}")
        if self.grouped not in GROUPED_PRODUCTS:
            raise ValueError(f"Mixture.grouped={self.grouped!r} is not one of {GROUPED_PRODUCTS}")
        if self.shared_expert_gate and self.shared_expert_features is None:
            raise ValueError("Mixture.shared_expert_gate=True needs a shared expert: set shared_expert_features")
        if not self.routed_scale > 0:
            raise ValueError(f"Mixture.routed_scale must be positive, got {self.routed_scale!r}")
        super().__post_init__()

    # --- routing ---------------------------------------------------------------------------------

    def route(self, rows: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Router logits ``[N, E]`` (float32), and each row's k weights and expert ids ``[N, k]``."""
        gate = self.param("gate", _init(("embed", None)), (rows.shape[-1], self.num_experts), self.param_dtype)
        logits = rows @ gate.astype(self.dtype)
        if self.router_bias:
            bias = self.param("gate_bias", _zeros((None,)), (self.num_experts,), self.param_dtype)
            logits = logits + bias.astype(self.dtype)
        logits = logits.astype(jnp.float32)
        if self.score == "softmax":
            probs = jax.nn.softmax(logits, axis=-1)
        else:
            probs = jax.nn.sigmoid(logits)
        choice = probs
        if self.score_bias:
            if not self.is_initializing() and not self.has_variable(BALANCE_COLLECTION, "score_bias"):
                raise ValueError(
                    f"this router chooses experts with a balancing bias, but the variables hold no "
                    f"{BALANCE_COLLECTION!r} collection with its score_bias; pass every collection the model "
                    f"was initialized or loaded with (e.g. {{**bundle.variables, 'params': ...}}), not 'params' alone"
                )
            bias = self.variable(BALANCE_COLLECTION, "score_bias", jnp.zeros, (self.num_experts,), jnp.float32)
            choice = probs + jax.lax.stop_gradient(bias.value)  # moved by a balancing rule, not by the loss
        if self.group_top_k is not None and self.group_top_k < self.groups:
            choice = self._keep_best_groups(choice)
        _, experts = jax.lax.top_k(choice, self.top_k)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
        if self.normalize_top_k:
            total = jnp.sum(weights, axis=-1, keepdims=True)
            weights = weights / (total + 1e-20 if self.score == "sigmoid" else total)
        # sigmoid scores are normalized over the experts for the balance statistics (DeepSeek-V3, eq. 19)
        shares = probs if self.score == "softmax" else probs / jnp.sum(probs, axis=-1, keepdims=True)
        self._record(logits, shares, experts)
        return logits, weights * self.routed_scale, experts

    def _keep_best_groups(self, choice: jax.Array) -> jax.Array:
        """The choice scores with every expert outside the ``group_top_k`` best groups set to -inf."""
        rows = choice.shape[0]
        grouped = choice.reshape(rows, self.groups, self.num_experts // self.groups)
        rating = jnp.sum(jax.lax.top_k(grouped, GROUP_RATING_EXPERTS)[0], axis=-1)  # [N, groups]
        _, best = jax.lax.top_k(rating, self.group_top_k)
        kept = jnp.zeros((rows, self.groups), bool).at[jnp.arange(rows)[:, None], best].set(True)
        return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(rows, self.num_experts)

    def _record(self, logits: jax.Array, probs: jax.Array, experts: jax.Array) -> None:
        """This layer's routing statistics, summed over its rows (see `router_metrics`)."""
        if self.is_initializing() or not self.is_mutable_collection(ROUTER_COLLECTION):
            return
        assigned = jnp.zeros((self.num_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)
        self.sow(ROUTER_COLLECTION, "expert_tokens", assigned)
        self.sow(ROUTER_COLLECTION, "expert_probability", jnp.sum(probs, axis=0))
        self.sow(ROUTER_COLLECTION, "z", jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2))
        self.sow(ROUTER_COLLECTION, "rows", jnp.asarray(logits.shape[0], jnp.float32))

    # --- experts ---------------------------------------------------------------------------------

    def _dispatch_global(self, rows, weights, experts, kernels):
        """Every (row, expert) assignment, sorted by expert, through grouped matrix products."""
        k = experts.shape[-1]
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # assignments grouped by expert, rows in order
        source = order // k  # the row each sorted assignment reads
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        out = self._grouped_product()(rows[source], flat[order], group_sizes, kernels)
        out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
        return jnp.zeros_like(rows).at[source].add(out)

    def _dispatch_exchange(self, rows, weights, experts, kernels):
        """Assignments traded over the expert axis to the devices holding their experts, and back
        (`dew.nn.expert_parallel`); the global dispatch when no step splits the experts."""
        split = expert_parallel.active()
        exchanged = None if split is None else expert_parallel.exchange(
            rows, weights, experts, kernels, split=split, num_experts=self.num_experts,
            capacity_factor=self.capacity_factor, product=self._grouped_product())
        if exchanged is None:
            out, dropped = self._dispatch_global(rows, weights, experts, kernels), jnp.zeros((), jnp.float32)
        else:
            out, dropped = exchanged
        if not self.is_initializing() and self.is_mutable_collection(ROUTER_COLLECTION):
            self.sow(ROUTER_COLLECTION, "dropped", dropped)
        return out

    def _grouped_product(self):
        """``product(sorted_rows, row_experts, group_sizes, kernels)``: the experts as grouped products."""
        grouped = self.grouped
        if grouped != "auto":
            product = {"ragged_dot": ragged_experts, "blocks": blocked_experts, "padded": padded_experts}[grouped]
        elif jax.default_backend() != "cpu":
            product = ragged_experts
        else:
            product = auto_cpu_experts
        return functools.partial(product, activation=self._activation())

    def _activation(self):
        """The experts' ``activation(gate, up)``."""
        if self.activation == "clamped_swiglu":
            return functools.partial(clamped_swiglu, alpha=self.swiglu_alpha, limit=self.swiglu_limit)
        return swiglu

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).astype(self.dtype)
        expert_parallel.note_mixture(self.num_experts)
        _, weights, experts = self.route(rows)
        kernels = Experts(self.num_experts, self.expert_features, self.num_layers, use_bias=self.expert_bias,
                          interleaved=self.gate_up == "interleaved", dtype=self.dtype,
                          param_dtype=self.param_dtype, name="experts")(shape[-1])
        out = getattr(self, f"_dispatch_{self.dispatch}")(rows, weights, experts, kernels)
        if self.shared_expert_features is not None:
            shared = SharedExpert(self.shared_expert_features, self.num_layers, dtype=self.dtype,
                                  param_dtype=self.param_dtype, name="shared_expert")(rows)
            if self.shared_expert_gate:
                gate = nn.Dense(1, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                                kernel_init=_init(("embed", None)), name="shared_expert_gate")
                shared = jax.nn.sigmoid(gate(rows)) * shared
            out = out + shared
        return out.reshape(shape)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU (Shazeer 2020, arXiv:2002.05202): ``silu(gate) * up``."""
    return nn.silu(gate) * up


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, alpha: float = 1.702, limit: float = 7.0) -> jax.Array:
    """GPT-OSS's SwiGLU: the gate clamped above and the up clamped both sides at ``limit``, a
    sigmoid of gain ``alpha`` on the gate, and the up shifted by one, as transformers' GptOssExperts."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class ExpertWeights(NamedTuple):
    """The routed experts' stacked kernels (gate and up ``[E, width, F]``, down ``[E, F, width]``)
    and, with ``expert_bias``, their biases (``[E, F]``, ``[E, F]``, ``[E, width]``)."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_bias: jax.Array | None = None
    up_bias: jax.Array | None = None
    down_bias: jax.Array | None = None


def ragged_experts(rows, row_experts, group_sizes, kernels, activation=swiglu):
    """Experts over rows sorted by expert, each projection one `jax.lax.ragged_dot` (plus the
    row's expert's bias, when the experts have biases). Rows past the groups (id E, the empty
    slots of an exchange) belong to no expert; their outputs are meaningless and go unread."""

    def project(x, kernel, bias):
        y = jax.lax.ragged_dot(x, kernel, group_sizes)
        return y if bias is None else y + bias[row_experts]

    hidden = activation(project(rows, kernels.gate, kernels.gate_bias), project(rows, kernels.up, kernels.up_bias))
    return project(hidden, kernels.down, kernels.down_bias)


def block_rows(assignments: int, num_experts: int) -> int:
    """Rows per block: about sqrt(2 * assignments) (padding against one kernel copy per block), a
    power of two no larger than the mean group (one row per block when rows are fewer than
    experts, as in decoding) and at most `MAX_BLOCK`."""
    by_padding = 2 ** int(math.log2(max(1.0, math.sqrt(2 * assignments))))
    by_groups = 2 ** int(math.log2(max(1, assignments // num_experts)))
    return min(by_padding, by_groups, MAX_BLOCK)


def blocked_experts(rows, row_experts, group_sizes, kernels, activation=swiglu):
    """Experts over rows sorted by expert, as batched products over blocks of rows.

    Each expert's rows are padded to whole blocks of `block_rows` rows (zero rows, whose outputs
    are zero and are dropped), every block is multiplied by its expert's kernels, and the rows are
    read back from their slots. The number of blocks is the most any routing can need,
    ``ceil((assignments + E * (block - 1)) / block)``, so shapes stay static. Rows past the groups
    (id E, the empty slots of an exchange) are in no block and read zero.
    """
    layout = _Blocks(block_rows(rows.shape[0], kernels.gate.shape[0]))
    return _experts_in_layout(layout, rows, *_sorted_positions(row_experts, group_sizes), group_sizes, kernels,
                              activation)[0]


def capacities(assignments: int, num_experts: int) -> tuple[int, ...]:
    """The padded product's rows per expert: an even share ``assignments / E`` times 1.25 and 1.5
    (`CAPACITY_STEPS`), each rounded up to 8 rows and at most every assignment. A step takes the
    smallest that holds its largest group, and blocks when none does."""
    share = assignments / num_experts
    return tuple(sorted({min(assignments, 8 * math.ceil(share * step / 8)) for step in CAPACITY_STEPS}))


def block_counts(assignments: int, num_experts: int, block: int) -> tuple[int, ...]:
    """The padded product's block layouts, as numbers of blocks of `block` rows: what a routing needs
    on average (the assignments in whole blocks, plus half a block of padding per expert), the most
    any routing can need, ``ceil((assignments + E * (block - 1)) / block)``, and one halfway. A step
    takes the fewest that hold its groups."""
    most = _most_blocks(assignments, num_experts, block)
    expected = min(-(-assignments // block) + num_experts // 2, most)
    return tuple(sorted({expected, (expected + most) // 2, most}))


def _most_blocks(assignments: int, num_experts: int, block: int) -> int:
    """The blocks of `block` rows any routing of `assignments` over `num_experts` groups fits in."""
    return -(-(assignments + num_experts * (block - 1)) // block)


def padded_layout(group_sizes: jax.Array, sizes: tuple[int, ...], counts: tuple[int, ...], block: int) -> jax.Array:
    """Which of the padded product's layouts a step takes: the first capacity of `sizes` that holds
    the largest group, else (index ``len(sizes) + i``) the first of `counts` whose blocks of `block`
    rows hold every group, each padded to whole blocks."""
    capacity = jnp.searchsorted(jnp.asarray(sizes), jnp.max(group_sizes))  # the first capacity >= it, else len(sizes)
    needed = jnp.sum(-(-group_sizes // block))
    return jnp.where(capacity < len(sizes), capacity, len(sizes) + jnp.searchsorted(jnp.asarray(counts), needed))


def padded_experts(rows, row_experts, group_sizes, kernels, activation=swiglu):
    """Experts over rows sorted by expert, as products over an expert-major ``[E, C, width]`` layout.

    Each expert's rows are padded to one capacity C, the smallest of `capacities` that holds the
    largest group, and each projection is one batched product with the stacked kernels as they
    are: no kernel is copied per block, and the kernels' gradients come out of the products whole.
    A routing whose largest group is past 1.5 even shares would pad the others past what blocks
    cost, so it takes blocks of twice `block_rows` rows instead, as few of `block_counts` as hold
    its groups (each block's kernels are copied, so fewer blocks save that copy too). A
    `jax.lax.switch` picks the layout in each step (`padded_layout`), so shapes stay static and no
    assignment is ever dropped. The gradient is written by hand (`_grouped_product`) so that what
    the backward pass keeps is the gate and up projections in the rows' own layout, whichever
    layout the step took. Rows past the groups (id E, the empty slots of an exchange) are in no
    expert and read zero.
    """
    assignments = rows.shape[0]
    num_experts = kernels.gate.shape[0]
    sizes = capacities(assignments, num_experts)
    # past the capacities, blocks twice `blocked_experts`' rows: this backward pass gathers each block's
    # kernels again, and half as many blocks halve that copy
    block = 2 * block_rows(assignments, num_experts)
    counts = block_counts(assignments, num_experts, block)
    experts, position = _sorted_positions(row_experts, group_sizes)
    which = padded_layout(group_sizes, sizes, counts, block)
    layouts = [_ByExpert(capacity) for capacity in sizes] + [_Blocks(block, count) for count in counts]
    rows, kernels = _varying_alike((rows, kernels))
    return _grouped_product(activation, tuple(layouts), rows, experts, position, group_sizes, which, kernels)


def auto_cpu_experts(rows, row_experts, group_sizes, kernels, activation=swiglu):
    """``grouped="auto"`` on a CPU: the padded product once experts average `MIN_PADDED_SHARE`
    assignments (training batches), blocks below that (decoding, where a block is a row)."""
    padded = rows.shape[0] >= MIN_PADDED_SHARE * kernels.gate.shape[0]
    return (padded_experts if padded else blocked_experts)(rows, row_experts, group_sizes, kernels, activation)


def _sorted_positions(row_experts, group_sizes):
    """Each sorted row's expert (E for rows in no group) and its place within its expert's group."""
    num_experts = group_sizes.shape[0]
    grouped = row_experts < num_experts
    starts = jnp.cumsum(group_sizes) - group_sizes
    position = jnp.arange(row_experts.shape[0]) - starts[jnp.where(grouped, row_experts, 0)]
    return jnp.where(grouped, row_experts, num_experts), position


def _varying_alike(tree):
    """Inside `jax.shard_map`: every leaf cast to vary over every manual axis any leaf varies over.

    A hand-written gradient must vary over the axes its primal does. Rows split over ``data`` meet
    kernels split over ``expert`` only; the cast lets autodiff sum the kernels' gradients over
    ``data`` (its transpose), as it does for the products it differentiates itself.
    """
    axes = frozenset().union(*(jax.typeof(leaf).mat.varying for leaf in jax.tree_util.tree_leaves(tree)))

    def cast(leaf):
        missing = tuple(sorted(axes - jax.typeof(leaf).mat.varying, key=str))
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree_util.tree_map(cast, tree)


class _ByExpert(NamedTuple):
    """Group g is expert g, padded to ``capacity`` rows."""

    capacity: int

    def place(self, experts, position, group_sizes):
        """(each sorted row's slot among ``groups * rows`` (past the end: none), rows per group,
        each group's expert (None: group g is expert g))."""
        num_experts = group_sizes.shape[0]
        slots = jnp.where(experts < num_experts, experts * self.capacity + position, num_experts * self.capacity)
        return slots, self.capacity, None


class _Blocks(NamedTuple):
    """Each group padded to whole blocks of ``block`` rows, as `blocked_experts` lays them out, in
    ``count`` blocks (None: the most any routing can need; a routing that needs more than ``count``
    would lose rows, so `padded_layout` never picks such a layout for it)."""

    block: int
    count: int | None = None

    def place(self, experts, position, group_sizes):
        num_experts, assignments = group_sizes.shape[0], experts.shape[0]
        num_blocks = self.count or _most_blocks(assignments, num_experts, self.block)
        padded_sizes = -(-group_sizes // self.block) * self.block
        padded_ends = jnp.cumsum(padded_sizes)
        padded_starts = padded_ends - padded_sizes
        slots = jnp.where(experts < num_experts, padded_starts[jnp.minimum(experts, num_experts - 1)] + position,
                          num_blocks * self.block)
        block_experts = jnp.minimum(
            jnp.searchsorted(padded_ends, jnp.arange(num_blocks) * self.block, side="right"), num_experts - 1)
        return slots, self.block, block_experts


def _grouped(values, slots, rows_per_group: int, groups: int):
    """Sorted rows ``[A, n]`` -> ``[groups, rows_per_group, n]``, zero where no row lands."""
    padded = jnp.zeros((groups * rows_per_group, values.shape[-1]), values.dtype)
    return padded.at[slots].set(values, mode="drop").reshape(groups, rows_per_group, -1)


def _ungrouped(values, slots):
    """``[groups, rows_per_group, n]`` -> the sorted rows ``[A, n]``; rows in no group read zero."""
    return values.reshape(-1, values.shape[-1]).at[slots].get(mode="fill", fill_value=0)


def _layout(layout, experts, position, group_sizes, kernels):
    """(slots, rows per group, groups, each group's kernels, each group's expert or None)."""
    slots, per_group, group_experts = layout.place(experts, position, group_sizes)
    if group_experts is not None:
        kernels = jax.tree_util.tree_map(lambda k: k[group_experts], kernels)
    return slots, per_group, kernels.gate.shape[0], kernels, group_experts


def _plus_bias(y, bias):
    return y if bias is None else y + bias[:, None, :].astype(y.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped_product(activation, layouts, rows, experts, position, group_sizes, which, kernels):
    return _grouped_forward(activation, layouts, rows, experts, position, group_sizes, which, kernels)[0]


def _experts_in_layout(layout, rows, experts, position, group_sizes, kernels, activation):
    """The experts over the sorted rows laid out by `layout`: (output, gate, up), each in the rows' layout."""
    slots, per_group, groups, k, _ = _layout(layout, experts, position, group_sizes, kernels)
    x = _grouped(rows, slots, per_group, groups)
    gate = _plus_bias(jnp.einsum("gcd,gdf->gcf", x, k.gate), k.gate_bias)
    up = _plus_bias(jnp.einsum("gcd,gdf->gcf", x, k.up), k.up_bias)
    out = _plus_bias(jnp.einsum("gcf,gfd->gcd", activation(gate, up), k.down), k.down_bias)
    return _ungrouped(out, slots), _ungrouped(gate, slots), _ungrouped(up, slots)


def _grouped_forward(activation, layouts, rows, experts, position, group_sizes, which, kernels):
    def branch(layout):
        return lambda rows, kernels: _experts_in_layout(layout, rows, experts, position, group_sizes, kernels,
                                                        activation)

    out, gate, up = jax.lax.switch(which, [branch(layout) for layout in layouts], rows, kernels)
    return out, (rows, experts, position, group_sizes, which, kernels, gate, up)


def _grouped_backward(activation, layouts, residuals, d_out):
    rows, experts, position, group_sizes, which, kernels, gate, up = residuals

    def branch(layout):
        def run(d_out, rows, gate, up, kernels):
            slots, per_group, groups, k, group_experts = _layout(layout, experts, position, group_sizes, kernels)
            dy, x, g, u = (_grouped(v, slots, per_group, groups) for v in (d_out, rows, gate, up))
            hidden, activation_vjp = jax.vjp(activation, g, u)
            dg, du = activation_vjp(jnp.einsum("gcd,gfd->gcf", dy, k.down))  # zero on padding, where dy is
            dx = jnp.einsum("gcf,gdf->gcd", dg, k.gate) + jnp.einsum("gcf,gdf->gcd", du, k.up)
            d_kernels = ExpertWeights(
                jnp.einsum("gcd,gcf->gdf", x, dg), jnp.einsum("gcd,gcf->gdf", x, du),
                jnp.einsum("gcf,gcd->gfd", hidden, dy),
                *(None if bias is None else d.sum(axis=1).astype(bias.dtype)
                  for bias, d in ((k.gate_bias, dg), (k.up_bias, du), (k.down_bias, dy))))
            if group_experts is not None:  # each block's gradients summed into its expert's
                d_kernels = jax.tree_util.tree_map(
                    lambda d, whole: jnp.zeros_like(whole).at[group_experts].add(d), d_kernels, kernels)
            d_kernels = jax.tree_util.tree_map(lambda d, whole: d.astype(whole.dtype), d_kernels, kernels)
            return _ungrouped(dx, slots).astype(rows.dtype), d_kernels
        return run

    d_rows, d_kernels = jax.lax.switch(which, [branch(layout) for layout in layouts], d_out, rows, gate, up, kernels)
    return d_rows, None, None, None, None, d_kernels


_grouped_product.defvjp(_grouped_forward, _grouped_backward)


class Experts(nn.Module):
    """The routed experts' stacked kernels: gate and up ``[E, width, F]``, down ``[E, F, width]``.

    ``interleaved`` stores gate and up as one ``gate_up_proj [E, width, 2F]``, gate in the even
    columns and up in the odd ones (GPT-OSS's layout); ``use_bias`` adds a bias per projection
    (``gate_up_proj_bias [E, 2F]`` interleaved alike, or ``gate_proj_bias`` and ``up_proj_bias``;
    ``down_proj_bias [E, width]``), zero at initialization.
    """

    num_experts: int
    features: int
    num_layers: int = 1
    use_bias: bool = False
    interleaved: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, width: int) -> ExpertWeights:
        experts, features = self.num_experts, self.features
        out_std = INIT_STD / math.sqrt(2 * self.num_layers)  # GPT-2's scaled residual init

        def param(name, init, shape):
            return self.param(name, init, shape, self.param_dtype).astype(self.dtype)

        gate_bias = up_bias = down_bias = None
        if self.interleaved:
            gate_up = param("gate_up_proj", _init(("expert", "embed", "mlp")), (experts, width, 2 * features))
            gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
            if self.use_bias:
                gate_up_bias = param("gate_up_proj_bias", _zeros(("expert", "mlp")), (experts, 2 * features))
                gate_bias, up_bias = gate_up_bias[..., 0::2], gate_up_bias[..., 1::2]
        else:
            gate = param("gate_proj", _init(("expert", "embed", "mlp")), (experts, width, features))
            up = param("up_proj", _init(("expert", "embed", "mlp")), (experts, width, features))
            if self.use_bias:
                gate_bias = param("gate_proj_bias", _zeros(("expert", "mlp")), (experts, features))
                up_bias = param("up_proj_bias", _zeros(("expert", "mlp")), (experts, features))
        down = param("down_proj", _init(("expert", "mlp", "embed"), out_std), (experts, features, width))
        if self.use_bias:
            down_bias = param("down_proj_bias", _zeros(("expert", "embed")), (experts, width))
        return ExpertWeights(gate, up, down, gate_bias, up_bias, down_bias)


class SharedExpert(nn.Module):
    """The expert every row goes through: SwiGLU, ``down(silu(gate(x)) * up(x))``, as Qwen names it."""

    features: int
    num_layers: int = 1
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, rows: jax.Array) -> jax.Array:
        width = rows.shape[-1]
        out_std = INIT_STD / math.sqrt(2 * self.num_layers)
        dense = dict(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
        gate = nn.Dense(self.features, kernel_init=_init(("embed", "mlp")), name="gate_proj", **dense)
        up = nn.Dense(self.features, kernel_init=_init(("embed", "mlp")), name="up_proj", **dense)
        down = nn.Dense(width, kernel_init=_init(("mlp", "embed"), out_std), name="down_proj", **dense)
        return down(nn.silu(gate(rows)) * up(rows))


# --- the router's statistics ---------------------------------------------------------------------


def router_metrics(collection: Mapping[str, Any]) -> dict[str, jax.Array]:
    """The routing metrics of one forward pass from its ``router`` collection (empty: no mixtures).

    ``balance``: transformers' load-balancing loss, ``E * sum_e f_e * P_e`` with ``f_e`` the share
    of (row, choice) assignments and ``P_e`` the mean router probability of expert ``e``, both
    pooled over every mixture layer (k for a perfectly even router). ``z``: the mean over layers
    and rows of ``logsumexp(logits)^2``. ``expert_{e}_tokens``: the assignments expert ``e``
    received, averaged over the mixture layers. ``dropped`` (layers with ``dispatch="exchange"``
    only): the assignments their full send buffers dropped, summed over those layers.
    """
    flat = traverse_util.flatten_dict(dict(collection)) if collection else {}
    sums: dict[str, jax.Array] = {}
    layers = 0
    for path, recorded in flat.items():
        name = path[-1]
        for value in (recorded if isinstance(recorded, tuple) else (recorded,)):
            value = jnp.asarray(value)
            keep = 1 if name in ("expert_tokens", "expert_probability") else 0
            total = jnp.sum(value.reshape((-1,) + value.shape[value.ndim - keep:]), axis=0)
            sums[name] = sums.get(name, 0.0) + total
            if name == "rows":
                layers += value.size  # a scanned stack records one entry per layer
    if not sums:
        return {}
    rows = sums["rows"]
    tokens, probability = sums["expert_tokens"], sums["expert_probability"]
    num_experts = tokens.shape[-1]
    metrics = {
        "balance": num_experts * jnp.sum((tokens / rows) * (probability / rows)),
        "z": sums["z"] / rows,
    }
    for e in range(num_experts):
        metrics[f"expert_{e}_tokens"] = tokens[e] / layers
    if "dropped" in sums:
        metrics["dropped"] = sums["dropped"]
    return metrics


def balanced_score_bias(balance: Mapping[str, Any], collection: Mapping[str, Any], rate: float) -> dict[str, Any]:
    """Every mixture layer's ``score_bias`` after one step of the auxiliary-loss-free balancing rule.

    DeepSeek-V3 (arXiv:2412.19437, section 2.1.2): ``bias_e += rate * sign(mean_e(load) - load_e)``,
    ``load_e`` the tokens routed to expert ``e`` by that layer in the step (its ``expert_tokens``
    in the ``router`` collection ``collection``, which sits at the same module path as the bias),
    so an underloaded expert's bias rises and an overloaded one's falls. A scanned stack's bias
    ``[layers, E]`` moves per layer. ``balance`` is the ``balance`` collection.
    """
    recorded = traverse_util.flatten_dict(dict(collection)) if collection else {}
    moved = {}
    for path, bias in traverse_util.flatten_dict(dict(balance)).items():
        counts = recorded.get(path[:-1] + ("expert_tokens",))
        if path[-1] != "score_bias" or counts is None:
            raise ValueError(
                f"the balance collection's {'/'.join(path)} has no expert_tokens recorded beside it in the "
                "router collection; apply the model with mutable=['router'] in the step that moves the bias"
            )
        load = sum(jnp.asarray(c, jnp.float32) for c in (counts if isinstance(counts, tuple) else (counts,)))
        mean = jnp.mean(load, axis=-1, keepdims=True)
        moved[path] = bias + jnp.asarray(rate, bias.dtype) * jnp.sign(mean - load).astype(bias.dtype)
    return traverse_util.unflatten_dict(moved)
