"""Image and video readers: ImageFolder, Digits, TFDSImages (no TensorFlow) and VideoFrames."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dew.data import Digits, ImageFolder, Partition, TFDSImages, VideoFrames
from dew.data.images import fit_square
from dew.data.tf_example import decode_example, encode_example

# ----------------------------------------------------------------------------------------------
# ImageFolder


def _marked(identity: int, size: int = 16) -> np.ndarray:
    """A square image whose left half holds `identity + 1` and right half `200 + identity`, so a
    read shows which file it came from and whether it was flipped."""
    image = np.empty((size, size, 3), np.uint8)
    image[:, : size // 2] = identity + 1
    image[:, size // 2 :] = 200 + identity
    return image


def _identify(images: np.ndarray) -> tuple[list[int], list[bool]]:
    left, right = images[:, :, 0, 0].min(axis=1), images[:, :, -1, 0].min(axis=1)
    flipped = left > right
    ids = np.where(flipped, right, left).astype(int) - 1
    return ids.tolist(), flipped.tolist()


def _folder(root: Path, classes=("cat", "dog", "emu"), per_class: int = 4) -> Path:
    identity = 0
    for name in classes:
        (root / name).mkdir(parents=True)
        for index in range(per_class):
            Image.fromarray(_marked(identity)).save(root / name / f"{index:02d}.png")
            identity += 1
    return root


def _epoch(iterator, batches: int) -> np.ndarray:
    return np.concatenate([next(iterator)["image"] for _ in range(batches)])


def test_image_folder_numbers_sorted_subfolders_and_visits_each_image_once_an_epoch(tmp_path):
    root = _folder(tmp_path / "images", classes=("zebra", "ant", "moth"))
    data = ImageFolder(str(root), 16).load(batch=4)
    assert data.records == 12 and data.val is None
    iterator = data.train(Partition())
    batch = next(iterator)
    assert batch["image"].shape == (4, 16, 16, 3) and batch["image"].dtype == np.uint8
    assert batch["label"].dtype == np.int32
    ids, flipped = _identify(batch["image"])
    # files sort as ant/00..03, moth/00..03, zebra/00..03, and classes are numbered in that order
    names = ["zebra"] * 4 + ["ant"] * 4 + ["moth"] * 4
    file_rank = sorted(range(12), key=lambda i: (names[i], i))
    expected_labels = [sorted(set(names)).index(names[file_rank[i]]) for i in range(12)]
    order = {file: index for index, file in enumerate(file_rank)}
    for identity, label in zip(ids, batch["label"]):
        assert label == expected_labels[order[identity]]
    rest = _epoch(iterator, 2)
    seen, _ = _identify(np.concatenate([batch["image"], rest]))
    assert sorted(seen) == list(range(12)) and not any(flipped)
    assert ImageFolder(str(root), 16).classes() == ["ant", "moth", "zebra"]


def test_images_are_cut_to_the_centred_square_then_resized(tmp_path):
    (tmp_path / "a").mkdir()
    wide = np.zeros((12, 20, 3), np.uint8)
    wide[:, :4] = 255  # the border that the centred 12x12 square leaves out
    wide[:, 16:] = 255
    wide[:, 4:16] = np.arange(12, dtype=np.uint8)[None, :, None] * 10
    Image.fromarray(wide).save(tmp_path / "a" / "wide.png")
    exact = next(ImageFolder(str(tmp_path), 12).load(batch=1).train(Partition()))["image"][0]
    np.testing.assert_array_equal(exact, wide[:, 4:16])
    small = next(ImageFolder(str(tmp_path), 6).load(batch=1).train(Partition()))["image"][0]
    assert small.shape == (6, 6, 3) and small.max() < 200  # no trace of the white border
    tall = fit_square(Image.fromarray(np.transpose(wide, (1, 0, 2))), 12)
    np.testing.assert_array_equal(tall, np.transpose(wide[:, 4:16], (1, 0, 2)))


def test_flips_are_keyed_by_seed_record_and_epoch_not_by_partitioning(tmp_path):
    root = _folder(tmp_path / "images", per_class=8)  # 24 images
    data = ImageFolder(str(root), 16, flip=True, seed=3).load(batch=8)

    def flips(partitions: int) -> list[dict[int, bool]]:
        iterators = [data.train(Partition(i, partitions)) for i in range(partitions)]
        epochs = []
        for _ in range(2):
            images = np.concatenate(
                [np.concatenate([next(it)["image"] for it in iterators]) for _ in range(3)]
            )
            ids, flipped = _identify(images)
            assert sorted(ids) == list(range(24))
            epochs.append(dict(zip(ids, flipped)))
        return epochs

    one, two = flips(1), flips(2)
    assert one == two  # the same record looks the same however the batch is split
    assert one == flips(1)
    assert 0 < sum(one[0].values()) < 24  # some records flipped, some not
    assert one[0] != one[1]  # and the choice changes with the epoch
    other_seed = ImageFolder(str(root), 16, flip=True, seed=4).load(batch=8)
    ids, flipped = _identify(_epoch(other_seed.train(Partition()), 3))
    assert dict(zip(ids, flipped)) != one[0]


def test_set_state_resumes_exactly_where_get_state_was_taken(tmp_path):
    root = _folder(tmp_path / "images")
    data = ImageFolder(str(root), 16, flip=True).load(batch=5)
    iterator = data.train(Partition())
    for _ in range(2):
        next(iterator)
    state = iterator.get_state()
    expected = [next(iterator) for _ in range(4)]  # crosses into the next epoch
    resumed = data.train(Partition())
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_two_partitions_read_disjoint_halves_of_each_global_batch(tmp_path):
    root = _folder(tmp_path / "images")
    data = ImageFolder(str(root), 16).load(batch=6)
    whole = next(data.train(Partition()))
    first = next(data.train(Partition(0, 2)))
    second = next(data.train(Partition(1, 2)))
    assert first["image"].shape[0] == second["image"].shape[0] == 3
    for key in whole:
        np.testing.assert_array_equal(np.concatenate([first[key], second[key]]), whole[key])


def test_validation_split_is_deterministic_disjoint_and_read_in_order(tmp_path):
    root = _folder(tmp_path / "images", per_class=10)  # 30 images
    folder = ImageFolder(str(root), 16, val_fraction=0.2, seed=1)
    data = folder.load(batch=4)
    assert data.records == 24
    val_ids = _identify(np.concatenate([b["image"] for b in data.val(Partition())]))[0]
    assert len(val_ids) == 6 and val_ids == sorted(val_ids)
    train_ids = _identify(_epoch(data.train(Partition()), 6))[0]
    assert sorted(set(train_ids) | set(val_ids)) == list(range(30))
    assert not set(train_ids) & set(val_ids)
    again = folder.load(batch=3)
    assert _identify(np.concatenate([b["image"] for b in again.val(Partition())]))[0] == val_ids
    other = ImageFolder(str(root), 16, val_fraction=0.2, seed=2).load(batch=4)
    assert _identify(np.concatenate([b["image"] for b in other.val(Partition())]))[0] != val_ids
    halves = [list(data.val(Partition(i, 2))) for i in range(2)]
    assert [len(b["image"]) for b in halves[0]] == [2, 1]  # the last 2 split over both too
    both = [np.concatenate([h[i]["image"] for h in halves]) for i in range(2)]
    assert _identify(np.concatenate(both))[0] == val_ids


def test_captions_come_from_the_caption_file_and_tokenize_replaces_them(tmp_path):
    root = _folder(tmp_path / "images", classes=("a",), per_class=2)
    captions = {"a/00.png": "first", "a/01.png": "second image"}
    (tmp_path / "captions.json").write_text(json.dumps(captions))
    folder = ImageFolder(str(root), 16, labels=False, caption_file=str(tmp_path / "captions.json"))
    batch = next(folder.load(batch=2).train(Partition()))
    ids, _ = _identify(batch["image"])
    assert [str(c) for c in batch["caption"]] == [["first", "second image"][i] for i in ids]
    assert "label" not in batch

    def tokenize(texts):
        return np.asarray([[len(text)] for text in texts], np.int32)

    tokens = next(folder.load(batch=2, tokenize=tokenize).train(Partition()))
    assert "caption" not in tokens and tokens["text"].shape == (2, 1)
    lines = "\n".join(json.dumps({"file": k, "caption": v}) for k, v in captions.items())
    (tmp_path / "captions.jsonl").write_text(lines)
    folder = ImageFolder(str(root), 16, labels=False, caption_file=str(tmp_path / "captions.jsonl"))
    assert len(next(folder.load(batch=2).train(Partition()))["caption"]) == 2
    (tmp_path / "partial.json").write_text(json.dumps({"a/00.png": "only one"}))
    with pytest.raises(ValueError, match="no caption for .*01.png"):
        ImageFolder(str(root), 16, caption_file=str(tmp_path / "partial.json")).load(batch=1)


def test_image_folder_errors_name_the_folder_or_file(tmp_path):
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    (tmp_path / "empty" / "cls" / "notes.txt").write_text("no images here")
    with pytest.raises(ValueError, match="no images under .*empty"):
        ImageFolder(str(tmp_path / "empty"), 8).load(batch=1)
    with pytest.raises(FileNotFoundError, match="missing"):
        ImageFolder(str(tmp_path / "missing"), 8).load(batch=1)
    (tmp_path / "loose").mkdir()
    Image.fromarray(_marked(0)).save(tmp_path / "loose" / "x.png")
    with pytest.raises(ValueError, match="labels=False"):
        ImageFolder(str(tmp_path / "loose"), 8).load(batch=1)
    assert next(ImageFolder(str(tmp_path / "loose"), 8, labels=False).load(batch=1).train(Partition()))
    (tmp_path / "bad" / "cls").mkdir(parents=True)
    (tmp_path / "bad" / "cls" / "broken.png").write_bytes(b"not a png at all")
    with pytest.raises(ValueError, match=r"Cannot read the image .*broken\.png"):
        next(ImageFolder(str(tmp_path / "bad"), 8).load(batch=1).train(Partition()))
    with pytest.raises(ValueError, match="image_size"):
        ImageFolder(str(tmp_path), 0)
    with pytest.raises(ValueError, match="val_fraction"):
        ImageFolder(str(tmp_path / "loose"), 8, labels=False, val_fraction=0.5).load(batch=1)


def test_split_names_a_subfolder(tmp_path):
    _folder(tmp_path / "train", classes=("a", "b"), per_class=2)
    data = ImageFolder(str(tmp_path), 16, split="train").load(batch=4)
    assert sorted(next(data.train(Partition()))["label"].tolist()) == [0, 0, 1, 1]


# ----------------------------------------------------------------------------------------------
# Digits


def test_digits_rescale_pixels_split_by_seed_and_resize():
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = Digits().arrays()
    assert images.shape == (1797, 8, 8, 1) and images.dtype == np.uint8 and images.max() == 255
    np.testing.assert_array_equal(images[..., 0], np.round(digits.images * 255 / 16).astype(np.uint8))
    np.testing.assert_array_equal(labels, digits.target)

    assert next(Digits().load(batch=1).train(Partition()))["image"].shape == (1, 8, 8, 1)
    data = Digits(seed=0).load(batch=32)
    assert data.records == 1797 - 359
    batch = next(data.train(Partition()))
    assert batch["image"].shape == (32, 8, 8, 1) and batch["label"].dtype == np.int32
    val = list(data.val(Partition()))
    val_images = np.concatenate([b["image"] for b in val])
    assert len(val_images) == 359 and set(np.concatenate([b["label"] for b in val])) == set(range(10))
    again = np.concatenate([b["image"] for b in Digits(seed=0).load(batch=64).val(Partition())])
    np.testing.assert_array_equal(again, val_images)
    other = np.concatenate([b["image"] for b in Digits(seed=1).load(batch=64).val(Partition())])
    assert not np.array_equal(other, val_images)

    rgb = next(Digits(image_size=32, channels=3, val_fraction=0.0).load(batch=4).train(Partition()))
    assert rgb["image"].shape == (4, 32, 32, 3) and rgb["image"].dtype == np.uint8
    np.testing.assert_array_equal(rgb["image"][..., 0], rgb["image"][..., 2])
    with pytest.raises(ValueError, match="channels"):
        Digits(channels=2)


# ----------------------------------------------------------------------------------------------
# tf.train.Example and TFDSImages


def _example_classes():
    """tf.train.Example built from its .proto description with the protobuf package."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="dew_test_example.proto", package="dewtest",
                                               syntax="proto3")
    F = descriptor_pb2.FieldDescriptorProto

    def message(name, fields, nested=()):
        m = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            field = m.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = type_name
        for entry in nested:
            m.nested_type.add().CopyFrom(entry)
        return m

    repeated, optional = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    message("BytesList", [("value", 1, F.TYPE_BYTES, repeated, None)])
    message("FloatList", [("value", 1, F.TYPE_FLOAT, repeated, None)])
    message("Int64List", [("value", 1, F.TYPE_INT64, repeated, None)])
    feature = message("Feature", [("bytes_list", 1, F.TYPE_MESSAGE, optional, ".dewtest.BytesList"),
                                  ("float_list", 2, F.TYPE_MESSAGE, optional, ".dewtest.FloatList"),
                                  ("int64_list", 3, F.TYPE_MESSAGE, optional, ".dewtest.Int64List")])
    feature.oneof_decl.add(name="kind")
    for field in feature.field:
        field.oneof_index = 0
    entry = descriptor_pb2.DescriptorProto(name="FeatureEntry", options=descriptor_pb2.MessageOptions(map_entry=True))
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=optional)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=optional, type_name=".dewtest.Feature")
    message("Features", [("feature", 1, F.TYPE_MESSAGE, repeated, ".dewtest.Features.FeatureEntry")], [entry])
    message("Example", [("features", 1, F.TYPE_MESSAGE, optional, ".dewtest.Features")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("dewtest.Example"))


def test_example_codec_agrees_with_the_protobuf_package():
    Example = _example_classes()
    features = {"image": b"\x89PNG\x00\xff" * 50, "label": 7, "ids": [-3, 0, 2**40],
                "weights": np.asarray([0.5, -1.25], np.float32), "text": ["a caption", "two"]}
    parsed = Example.FromString(encode_example(features))
    assert parsed.features.feature["image"].bytes_list.value == [features["image"]]
    assert list(parsed.features.feature["ids"].int64_list.value) == [-3, 0, 2**40]
    assert list(parsed.features.feature["weights"].float_list.value) == [0.5, -1.25]

    theirs = Example()
    theirs.features.feature["label"].int64_list.value.extend([5, -1])
    theirs.features.feature["image"].bytes_list.value.append(b"bytes")
    theirs.features.feature["score"].float_list.value.extend([1.5])
    decoded = decode_example(theirs.SerializeToString())
    assert decoded["label"].tolist() == [5, -1] and decoded["image"] == [b"bytes"]
    assert decoded["score"].tolist() == [1.5]
    ours = decode_example(encode_example(features))
    assert ours["text"] == [b"a caption", b"two"] and ours["ids"].tolist() == [-3, 0, 2**40]
    assert decode_example(encode_example({"x": 1})) != decode_example(encode_example({"x": 2}))


def _tfds_directory(root: Path, images: list[np.ndarray], labels: list[int], shards: int = 2) -> Path:
    """A prepared-TFDS layout: dataset_info.json, features.json and ArrayRecord shards."""
    from array_record.python.array_record_module import ArrayRecordWriter

    root.mkdir(parents=True)
    per_shard = -(-len(images) // shards)
    lengths = []
    for shard in range(shards):
        path = root / f"toy-train.array_record-{shard:05d}-of-{shards:05d}"
        writer = ArrayRecordWriter(str(path), "group_size:1")
        chunk = range(shard * per_shard, min((shard + 1) * per_shard, len(images)))
        for index in chunk:
            encoded = Path(root.parent / "tmp.png")
            Image.fromarray(images[index]).save(encoded)
            writer.write(encode_example({"image": encoded.read_bytes(), "label": labels[index],
                                         "file_name": f"img{index}.png"}))
        writer.close()
        lengths.append(str(len(chunk)))
    info = {"name": "toy", "version": "1.0.0", "fileFormat": "array_record",
            "splits": [{"name": "train", "shardLengths": lengths, "numBytes": "0"}]}
    (root / "dataset_info.json").write_text(json.dumps(info))
    features = {"pythonClassName": "tensorflow_datasets.core.features.features_dict.FeaturesDict",
                "featuresDict": {"features": {
                    "image": {"pythonClassName": "tensorflow_datasets.core.features.image_feature.Image",
                              "image": {"shape": {"dimensions": ["-1", "-1", "3"]}, "dtype": "uint8",
                                        "encodingFormat": "png"}},
                    "label": {"pythonClassName": "tensorflow_datasets.core.features.class_label_feature.ClassLabel",
                              "classLabel": {"numClasses": "10"}},
                    "file_name": {"pythonClassName": "tensorflow_datasets.core.features.text_feature.Text",
                                  "text": {}}}}}
    (root / "features.json").write_text(json.dumps(features))
    return root


def test_tfds_directory_round_trips_images_and_labels_without_tensorflow(tmp_path):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (10, 10, 3), dtype=np.uint8) for _ in range(10)]
    labels = [int(x) for x in rng.integers(0, 10, 10)]
    root = _tfds_directory(tmp_path / "toy" / "1.0.0", images, labels)
    data = TFDSImages(str(root), image_size=10, val_batches=1).load(batch=2)
    assert data.records == 8
    iterator = data.train(Partition())
    read = [next(iterator) for _ in range(4)]
    got = np.concatenate([b["image"] for b in read])
    got_labels = np.concatenate([b["label"] for b in read])
    assert got.dtype == np.uint8 and got_labels.dtype == np.int32
    matched = []
    for image, label in zip(got, got_labels):
        index = next(i for i, want in enumerate(images) if np.array_equal(want, image))
        assert labels[index] == label
        matched.append(index)
    assert sorted(matched) == list(range(8))  # one epoch of the records left for training
    val = list(data.val(Partition()))
    assert len(val) == 1
    np.testing.assert_array_equal(val[0]["image"], np.stack(images[8:]))
    assert val[0]["label"].tolist() == labels[8:]

    resized = next(TFDSImages(str(root), image_size=4).load(batch=3).train(Partition()))
    assert resized["image"].shape == (3, 4, 4, 3) and TFDSImages(str(root)).load(batch=2).val is None
    captions = TFDSImages(str(root), image_size=10, caption_key="file_name", label_key=None)
    batch = next(captions.load(batch=2).train(Partition()))
    assert "label" not in batch and all(str(c).startswith("img") for c in batch["caption"])


TFDS_FIXTURE = Path(__file__).parent / "fixtures" / "tfds"  # tools/tfds_fixture.py


@pytest.mark.parametrize("split", ["train", "test"])
@pytest.mark.parametrize("image_key", ["image", "image_png"])
def test_a_directory_tfds_prepared_reads_as_tfds_reads_it(split, image_key):
    """Shards written by TFDS itself (JPEG bytes as flowers stores them, and PNG): every record's
    image, label and caption are the ones `builder.as_data_source` decodes, at 12 px."""
    reference = np.load(TFDS_FIXTURE / "reference.npz")
    captions = reference[f"{split}/caption"].tolist()
    data = TFDSImages(str(TFDS_FIXTURE / "dew_toy" / "1.0.0"), split=split, image_size=12,
                      image_key=image_key, caption_key="caption").load(batch=2)
    assert data.records == len(captions)
    iterator = data.train(Partition())
    batches = [next(iterator) for _ in range(len(captions) // 2)]  # one epoch
    seen = []
    for batch in batches:
        for image, label, caption in zip(batch["image"], batch["label"], batch["caption"]):
            index = captions.index(str(caption))
            want = fit_square(Image.fromarray(reference[f"{split}/{image_key}/{index}"]), 12)
            np.testing.assert_array_equal(image, want)
            assert label == reference[f"{split}/label"][index]
            # Negative control: the neighbouring record's image is not a match.
            other = reference[f"{split}/{image_key}/{(index + 1) % len(captions)}"]
            assert not np.array_equal(image, fit_square(Image.fromarray(other), 12))
            seen.append(index)
    assert sorted(seen) == list(range(len(captions)))


def test_tfds_errors_name_what_is_missing(tmp_path):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for _ in range(4)]
    root = _tfds_directory(tmp_path / "toy" / "1.0.0", images, [0, 1, 2, 3], shards=1)
    with pytest.raises(FileNotFoundError, match="dataset_info.json"):
        TFDSImages(str(tmp_path)).load(batch=2)
    with pytest.raises(FileNotFoundError, match="'test'.*'train'"):
        TFDSImages(str(root), split="test").load(batch=2)
    with pytest.raises(ValueError, match="label_key='labels'.*label_key=None"):
        TFDSImages(str(root), label_key="labels").load(batch=2)
    with pytest.raises(ValueError, match="val_batches=2 of 2 holds out 4"):
        TFDSImages(str(root), val_batches=2).load(batch=2)


# ----------------------------------------------------------------------------------------------
# VideoFrames


def _clips(root: Path, lengths: dict[str, int]) -> Path:
    for clip, (name, length) in enumerate(lengths.items()):
        (root / name).mkdir(parents=True)
        for frame in range(length):
            value = np.full((12, 12, 3), clip * 40 + frame, np.uint8)
            Image.fromarray(value).save(root / name / f"frame{frame}.png")  # frame10 sorts after frame9
    return root


def test_video_frames_yield_windows_of_consecutive_frames_in_order(tmp_path):
    root = _clips(tmp_path / "clips", {"a": 12, "b": 4})
    data = VideoFrames(str(root), frames=3, image_size=6, stride=2).load(batch=2)
    assert data.records == 5 + 1  # starts 0, 2, 4, 6, 8 in a; 0 in b
    iterator = data.train(Partition())
    videos = np.concatenate([next(iterator)["video"] for _ in range(3)])
    assert videos.shape == (6, 3, 6, 6, 3) and videos.dtype == np.uint8
    firsts = sorted(int(v[0, 0, 0, 0]) for v in videos)
    assert firsts == [0, 2, 4, 6, 8, 40]
    for video in videos:
        values = video[:, 0, 0, 0].astype(int)
        assert np.all(np.diff(values) == 1) and np.all(video == video[:, :1, :1, :1])


def test_video_clip_shorter_than_the_window_is_named(tmp_path):
    root = _clips(tmp_path / "clips", {"long": 6, "short": 2})
    with pytest.raises(ValueError, match=r"short has 2 frames, fewer than frames=3"):
        VideoFrames(str(root), frames=3, image_size=6).load(batch=1)
    with pytest.raises(ValueError, match="no clips"):
        (tmp_path / "none").mkdir()
        VideoFrames(str(tmp_path / "none"), frames=3, image_size=6).load(batch=1)


def test_video_validation_holds_out_whole_clips(tmp_path):
    root = _clips(tmp_path / "clips", {f"c{i}": 4 for i in range(5)})
    data = VideoFrames(str(root), frames=2, image_size=4, val_fraction=0.2).load(batch=3)
    val = np.concatenate([b["video"] for b in data.val(Partition())])
    assert val.shape == (3, 2, 4, 4, 3)
    assert len({int(v[0, 0, 0, 0]) // 40 for v in val}) == 1  # every window from one clip
    assert data.records == 12
