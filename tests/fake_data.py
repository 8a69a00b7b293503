"""Tiny datasets written in the REAL on-disk formats the loaders read, for tests.

Every writer puts files under a data directory (the one ``PFL_DATA_DIR`` / ``--data-dir`` names)
exactly where :mod:`pfl_core.data` looks for them:

* :func:`write_mnist` / :func:`write_mnist_layout`: torchvision's MNIST-like idx files
  (``<folder>/raw/<stem>-images-idx3-ubyte``, uncompressed; FashionMNIST and EMNIST via
  ``folder``/``stems``);
* :func:`write_cifar10` / :func:`write_cifar_layout`: torchvision's CIFAR python pickles
  (``cifar-10-batches-py/data_batch_1..5``, ``test_batch``, ``batches.meta``). torchvision checks
  every file's md5 against hard-coded values, so the md5s of the written files have to be swapped
  in: in-process with ``monkeypatch`` (:func:`patch_cifar_md5`), in a subprocess with the
  ``sitecustomize`` hook of :func:`cifar_md5_hook_env`;
* :func:`write_femnist`: LEAF FEMNIST JSON files (``femnist/train/*.json``);
* :func:`write_metadataset`: Meta-Dataset sources, TFRecords written with the ``tfrecord`` package
  (``metadataset/records/<source>/<class>.tfrecords``) and image folders
  (``metadataset/folders/<source>/train/<class>/*.png``);
* :func:`write_cinic10`: CINIC-10 PNG folders (``CINIC-10/{train,valid,test}/<class>/*.png``);
* :func:`write_miniimagenet`: learn2learn's mini-ImageNet cache pickles
  (``mini-imagenet/mini-imagenet-cache-{train,validation,test}.pkl``);
* :func:`write_cifar10c`: CIFAR-10-C ``.npy`` files (``CIFAR-10-C/<corruption>.npy``, ``labels.npy``);
* :func:`write_all`: everything every suite's ``smoke`` profile reads, sized for it (see there).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np

MNIST_STEMS = {"train": "train", "test": "t10k"}

# ------------------------------------------------------------------------------------- MNIST idx


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX file as read by torchvision: big-endian magic (0x08 = uint8, ndim) then dims, then data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def fake_images(n: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """``n`` uniform-noise uint8 images of ``shape``."""
    return np.random.default_rng(seed).integers(0, 256, size=(n, *shape), dtype=np.uint8)


def write_mnist_layout(root: Path, folder: str, prefix: dict[str, str], num_classes: int) -> dict:
    """Noise idx files under root/<folder>/raw, 7 train and 3 test images (labels ``arange % C``):
    torchvision 0.29 reads only the extracted files (its download step gunzips the .gz archives),
    so that is what must exist on disk. Returns ``{split: (images, labels)}``."""
    arrays = {}
    for i, (split, stem) in enumerate(prefix.items()):
        n = 7 if split == "train" else 3
        images = fake_images(n, (28, 28), seed=i)
        labels = np.arange(n) % num_classes
        write_idx(root / folder / "raw" / f"{stem}-images-idx3-ubyte", images)
        write_idx(root / folder / "raw" / f"{stem}-labels-idx1-ubyte", labels)
        arrays[split] = (images, labels)
    return arrays


def spot_images(n: int) -> np.ndarray:
    """Image i is black with one bright pixel (200 + i % 50) at a spot that differs by i."""
    images = np.zeros((n, 28, 28), dtype=np.uint8)
    for i in range(n):
        images[i, 3 + i % 7, 16 + i % 5] = 200 + i % 50
    return images


def write_mnist(root: Path, n_train: int = 100, n_test: int = 3, folder: str = "MNIST",
                stems: dict[str, str] = MNIST_STEMS) -> tuple[np.ndarray, np.ndarray]:
    """MNIST-layout idx files under ``root/<folder>/raw`` (``folder="FashionMNIST"`` for fmnist).

    Train image i is :func:`spot_images`' image i with label ``i % 10``; the test split repeats the
    first ``n_test`` train images and labels. Returns the train (images, labels)."""
    images, labels = spot_images(max(n_train, n_test)), np.arange(max(n_train, n_test)) % 10
    raw = root / folder / "raw"
    write_idx(raw / f"{stems['train']}-images-idx3-ubyte", images[:n_train])
    write_idx(raw / f"{stems['train']}-labels-idx1-ubyte", labels[:n_train])
    write_idx(raw / f"{stems['test']}-images-idx3-ubyte", images[:n_test])
    write_idx(raw / f"{stems['test']}-labels-idx1-ubyte", labels[:n_test])
    return images[:n_train], labels[:n_train]


# --------------------------------------------------------------------------------- CIFAR pickles


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _write_cifar(root: Path, cls: type, n: int) -> tuple[dict, dict]:
    """CIFAR pickles of ``n`` images per file (data: (n, 3072) uint8 in CHW order); returns
    ``({split: (images, labels)}, md5s)`` with ``md5s`` = the class attributes ``train_list``,
    ``test_list`` and ``meta`` as they must read for torchvision to accept the written files."""
    from torchvision import datasets as tv

    cifar100 = cls is tv.CIFAR100
    folder = root / cls.base_folder
    folder.mkdir(parents=True, exist_ok=True)
    label_key = "fine_labels" if cifar100 else "labels"
    num_classes = 100 if cifar100 else 10
    arrays: dict[str, list] = {"train": [], "test": []}
    md5s: dict = {}
    for split, entries in (("train", cls.train_list), ("test", cls.test_list)):
        patched = []
        for i, (filename, _) in enumerate(entries):
            images = fake_images(n, (3, 32, 32), seed=10 * i + (split == "test"))
            labels = [(3 * i + j) % num_classes for j in range(n)]
            with open(folder / filename, "wb") as f:
                pickle.dump({"data": images.reshape(n, -1), label_key: labels}, f)
            patched.append([filename, md5(folder / filename)])
            arrays[split].append((images, labels))
        md5s[f"{split}_list"] = patched
    names = [f"class{k}" for k in range(num_classes)]
    with open(folder / cls.meta["filename"], "wb") as f:
        pickle.dump({cls.meta["key"]: names}, f)
    md5s["meta"] = {**cls.meta, "md5": md5(folder / cls.meta["filename"])}
    joined = {k: (np.concatenate([a for a, _ in v]), sum((b for _, b in v), [])) for k, v in arrays.items()}
    return joined, md5s


def patch_cifar_md5(cls: type, md5s: dict, monkeypatch) -> None:
    """torchvision checks every CIFAR file's md5 against the class's hard-coded list; swap in the
    md5s of the files written (on the class, for this test only: ``monkeypatch`` undoes it). The
    loader's real code path is otherwise unchanged."""
    for attr, value in md5s.items():
        monkeypatch.setattr(cls, attr, value)


def write_cifar_layout(root: Path, cls: type, monkeypatch, n_per_file: int = 4) -> dict:
    """Tiny CIFAR-10/100 pickles (``cls`` = torchvision's ``CIFAR10``/``CIFAR100``) with their md5s
    patched in through ``monkeypatch`` (see :func:`patch_cifar_md5`); image j of file i is noise
    with seed ``10 i + is_test``, label ``(3 i + j) % C``. Returns ``{split: (images, labels)}``."""
    arrays, md5s = _write_cifar(root, cls, n_per_file)
    patch_cifar_md5(cls, md5s, monkeypatch)
    return arrays


def write_cifar10(root: Path, n_per_batch: int, monkeypatch=None) -> dict:
    """CIFAR-10 python pickles under ``root/cifar-10-batches-py``: 5 train batches and a test batch
    of ``n_per_batch`` images each (labels cycle through the 10 classes). With ``monkeypatch``
    the md5s are patched in for this test (:func:`patch_cifar_md5`). Returns the md5s, for
    :func:`patch_cifar_md5` later or :func:`cifar_md5_hook_env` for a subprocess."""
    from torchvision import datasets as tv

    _, md5s = _write_cifar(root, tv.CIFAR10, n_per_batch)
    if monkeypatch is not None:
        patch_cifar_md5(tv.CIFAR10, md5s, monkeypatch)
    return md5s


HOOK = '''\
"""Written by tests/fake_data.py for one test's subprocess only (found through PYTHONPATH).
torchvision checks every CIFAR file's md5 against hard-coded values; the test's CIFAR files are
generated, so their md5s (from $PFL_TEST_CIFAR10_MD5) replace those values on the class. Only
that check changes: the loader reads the files as usual."""
import json as _json
import os as _os

_spec = _os.environ.get("PFL_TEST_CIFAR10_MD5")
if _spec:
    from torchvision.datasets import CIFAR10 as _CIFAR10

    with open(_spec) as _f:
        for _attr, _value in _json.load(_f).items():
            setattr(_CIFAR10, _attr, _value)
'''


def cifar_md5_hook_env(hook_dir: Path, md5s: dict) -> dict[str, str]:
    """Environment variables that make a Python subprocess (e.g. ``make`` -> ``pflbench``) accept
    the CIFAR-10 files of :func:`write_cifar10`: a ``sitecustomize.py`` in ``hook_dir`` (put first
    on ``PYTHONPATH``) patches the md5s, read from a JSON file, onto torchvision's class at start."""
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    spec = hook_dir / "cifar10_md5.json"
    spec.write_text(json.dumps(md5s))
    path = os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "PFL_TEST_CIFAR10_MD5": str(spec)}


# ------------------------------------------------------------------------------- CINIC-10, mini-ImageNet

CINIC_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def write_cinic10(root: Path, per_class: int = 2, classes: tuple[str, ...] = CINIC_CLASSES) -> dict:
    """CINIC-10's unpacked layout: ``root/CINIC-10/{train,valid,test}/<class>/<split>-<k>.png``, 32x32
    RGB noise PNGs. Returns ``{split: (images (N, 32, 32, 3), labels)}`` in ImageFolder order
    (classes by folder name, files by name), ``split`` in train/val/test."""
    from PIL import Image

    arrays = {}
    for s, (split, folder) in enumerate((("train", "train"), ("val", "valid"), ("test", "test"))):
        images, labels = [], []
        for label, name in enumerate(sorted(classes)):
            target = root / "CINIC-10" / folder / name
            target.mkdir(parents=True, exist_ok=True)
            batch = fake_images(per_class, (32, 32, 3), seed=100 * s + label)
            for k, rgb in enumerate(batch):
                Image.fromarray(rgb).save(target / f"{folder}-{k:05d}.png")
            images.append(batch)
            labels += [label] * per_class
        arrays[split] = (np.concatenate(images), np.asarray(labels))
    return arrays


def write_miniimagenet(root: Path, classes: dict[str, int] | None = None, per_class: int = 3,
                       size: int = 84) -> dict:
    """learn2learn's mini-ImageNet cache files ``root/mini-imagenet/mini-imagenet-cache-<mode>.pkl``:
    a pickled dict ``{"image_data": uint8 (N, size, size, 3), "class_dict": {wnid: [rows]}}``, the
    rows of a class interleaved with the others' (so the loader must read ``class_dict``).
    ``classes``: classes per split (default 4/2/2). Returns ``{split: (images, labels within the
    file)}`` for split in train/val/test."""
    classes = classes or {"train": 4, "val": 2, "test": 2}
    folder = root / "mini-imagenet"
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for s, (split, mode) in enumerate((("train", "train"), ("val", "validation"), ("test", "test"))):
        n = classes[split] * per_class
        labels = np.arange(n) % classes[split]
        images = fake_images(n, (size, size, 3), seed=200 + s)
        class_dict = {f"n{s}{k:07d}": np.flatnonzero(labels == k).tolist() for k in range(classes[split])}
        with open(folder / f"mini-imagenet-cache-{mode}.pkl", "wb") as f:
            pickle.dump({"image_data": images, "class_dict": class_dict}, f)
        arrays[split] = (images, labels)
    return arrays


# ------------------------------------------------------------------------------------ LEAF FEMNIST


def leaf_file(path: Path, writers: dict[str, list[tuple[np.ndarray, int]]]) -> None:
    """One LEAF JSON file: flattened 28x28 floats k/255 (white = 1.0), int labels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"users": list(writers), "num_samples": [len(v) for v in writers.values()],
            "user_data": {u: {"x": [(img.reshape(-1) / 255.0).tolist() for img, _ in v],
                              "y": [int(lab) for _, lab in v]} for u, v in writers.items()}}
    path.write_text(json.dumps(blob))


def femnist_files(root: Path) -> dict[str, list[tuple[np.ndarray, int]]]:
    """Five writers (3, 4, 2, 5, 3 images; noise, random labels, one label 61) in two LEAF files."""
    rng = np.random.default_rng(0)
    writers = {}
    sizes = {"f0003_12": 3, "f0001_40": 4, "f0100_07": 2, "f0002_33": 5, "f0050_01": 3}
    for w, n in sizes.items():
        writers[w] = [(rng.integers(0, 256, (28, 28)).astype(np.uint8), int(rng.integers(0, 62)))
                      for _ in range(n)]
    writers["f0001_40"][0] = (writers["f0001_40"][0][0], 61)
    names = list(writers)
    leaf_file(root / "femnist" / "train" / "all_data_0_niid_1_keep_0_train_9.json",
              {w: writers[w] for w in names[:3]})
    leaf_file(root / "femnist" / "train" / "all_data_1_niid_1_keep_0_train_9.json",
              {w: writers[w] for w in names[3:]})
    return writers


def write_femnist(root: Path, writers: int = 12, per_writer: int = 30, files: int = 2,
                  seed: int = 0) -> dict[str, list[tuple[np.ndarray, int]]]:
    """``writers`` LEAF writers (``f0000_00``, ...) of ``per_writer`` noise images each, labels
    cycling through the 62 classes from a writer-dependent offset, spread over ``files`` JSON
    files under ``root/femnist/train``. Returns ``{writer: [(image, label), ...]}``."""
    rng = np.random.default_rng(seed)
    data = {}
    for w in range(writers):
        images = rng.integers(0, 256, (per_writer, 28, 28)).astype(np.uint8)
        data[f"f{w:04d}_{w % 100:02d}"] = [(images[j], (7 * w + j) % 62) for j in range(per_writer)]
    names = list(data)
    for k in range(files):
        leaf_file(root / "femnist" / "train" / f"all_data_{k}_niid_1_keep_0_train_9.json",
                  {w: data[w] for w in names[k::files]})
    return data


# ----------------------------------------------------------------------------------- Meta-Dataset


def jpeg_bytes(rgb: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG")
    return buf.getvalue()


def solid(color: tuple[int, int, int], size: int = 40) -> np.ndarray:
    return np.tile(np.array(color, dtype=np.uint8), (size, size, 1))


def write_records(folder: Path, num_classes: int, per_class: int, base: int) -> None:
    """Meta-Dataset converter layout: <class>.tfrecords, Examples with 'image' (JPEG) and 'label'.
    Image j of class c is a solid colour that encodes (base, c, j) in its RGB values."""
    from tfrecord.writer import TFRecordWriter

    folder.mkdir(parents=True, exist_ok=True)
    for c in range(num_classes):
        writer = TFRecordWriter(str(folder / f"{c}.tfrecords"))
        for j in range(per_class):
            image = jpeg_bytes(solid((base, 20 * c, 8 * j)))
            writer.write({"image": (image, "byte"), "label": (c, "int")})
        writer.close()


def write_folder(folder: Path, num_classes: int, per_class: int) -> None:
    """An ImageFolder with a ``train`` sub-folder: ``train/n<c>/img<j>.png``, solid (100, 20c, 8j)."""
    from PIL import Image

    for c in range(num_classes):
        d = folder / "train" / f"n{c:03d}"
        d.mkdir(parents=True, exist_ok=True)
        for j in range(per_class):
            Image.fromarray(solid((100, 20 * c, 8 * j), size=32)).save(d / f"img{j}.png")


def write_metadataset(root: Path, sources=None, classes: int = 10, per_class: int = 6) -> list[str]:
    """Meta-Dataset sources under ``root/metadataset``: the loader's record sources as TFRecords,
    its folder sources (mini_imagenet, cifar_fs) as PNG folders; ``classes`` classes of
    ``per_class`` images each. ``sources`` defaults to all 8 of the loader's default ``sources``
    (the CAFeMe suites do not narrow them). Returns the sources written."""
    from pfl_core.data.metadataset import FOLDER_SOURCES, SOURCES

    sources = list(SOURCES if sources is None else sources)
    for k, name in enumerate(sources):
        if name in FOLDER_SOURCES:
            write_folder(root / "metadataset" / "folders" / name, classes, per_class)
        else:
            write_records(root / "metadataset" / "records" / name, classes, per_class, base=25 * k)
    return sources


# ------------------------------------------------------------------------------ every smoke suite

#: sizes for every suite's smoke profile (see :func:`write_all`)
SMOKE_SIZES = {"mnist_train": 1200, "mnist_test": 200, "cifar_per_batch": 240,
               "femnist_writers": 12, "femnist_per_writer": 30,
               "metadataset_classes": 10, "metadataset_per_class": 6}


def write_all(root: Path) -> dict:
    """Every dataset the suites' ``smoke`` profiles read, in the real formats, under ``root``:

    * MNIST and FashionMNIST, 1,200 train / 200 test: CAFeMe smoke subsamples 1,000 RMNIST
      images (so the subsample path runs) into 10 clients (Shards: 20 shards of 50); CGPFL smoke
      gives 40 clients 30-60 samples of 3 classes each (<= 22 per class; 120 per class exist);
    * CIFAR-10, 5 x 240 train + 240 test (1,200 train for the 1,000-sample subsample; 1,440 for
      CGPFL's ``split: all``);
    * FEMNIST, 12 writers x 30 images (smoke: natural partition of 10 writers);
    * Meta-Dataset, all 8 default sources x 10 classes x 6 images (smoke: 10 clients x 10 classes
      x 6 images; ``classes_per_client`` is 10, so 10 classes per source is the minimum).

    Returns the CIFAR-10 md5s (for :func:`patch_cifar_md5` / :func:`cifar_md5_hook_env`)."""
    s = SMOKE_SIZES
    write_mnist(root, s["mnist_train"], s["mnist_test"], folder="MNIST")
    write_mnist(root, s["mnist_train"], s["mnist_test"], folder="FashionMNIST")
    md5s = write_cifar10(root, s["cifar_per_batch"])
    write_femnist(root, writers=s["femnist_writers"], per_writer=s["femnist_per_writer"])
    write_metadataset(root, classes=s["metadataset_classes"], per_class=s["metadataset_per_class"])
    return md5s


#: sizes of the MetaVers smoke data (see :func:`write_metavers`)
METAVERS_SIZES = {"cifar100_per_file": 2000, "cinic_per_class": 48, "mini_classes": {"train": 8, "val": 5, "test": 5},
                  "mini_per_class": 6}


def write_metavers(root: Path) -> dict:
    """What the MetaVers suites' ``smoke`` profiles read beyond :func:`write_all`, in the real formats:

    * CIFAR-100, 2,000 train / 2,000 test pickles (20 per class): Tables 2-4 cut 600 val images and
      give 40 clients 10 classes each (4 clients per class, 2-4 train images of each); Table 6's
      ``cifar100_novel`` merges them (40 per class: 64 train classes in 8 shards, 16 validation and 20
      test classes for 5-way groups of 2 users);
    * CINIC-10, 48 PNGs per class and split (40 clients of 4 classes: 16 clients per class, 2-4 images of each);
    * mini-ImageNet, learn2learn's cache pickles of 8 / 5 / 5 classes x 6 images at 84x84 (Table 6:
      8 shards of the train classes; 5-way validation and test groups of 2 users).

    Returns the CIFAR-100 md5s (for :func:`patch_cifar_md5` on torchvision's ``CIFAR100``)."""
    from torchvision import datasets as tv

    s = METAVERS_SIZES
    _, md5s = _write_cifar(root, tv.CIFAR100, s["cifar100_per_file"])
    write_cinic10(root, per_class=s["cinic_per_class"])
    write_miniimagenet(root, classes=s["mini_classes"], per_class=s["mini_per_class"])
    return md5s


def write_cifar10c(root: Path, corruptions: tuple[str, ...], per_severity: int, seed: int = 0) -> np.ndarray:
    """CIFAR-10-C in the release's layout: ``root/CIFAR-10-C/<corruption>.npy`` (5 * per_severity, 32,
    32, 3) uint8 and ``labels.npy``. Each severity block holds the same labels (a shuffled balanced
    set, as the release repeats the CIFAR-10 test labels); pixel (0, 0) of row r of corruption k is
    (r % 256, r // 256, k), so a test can tell which row of which file an image came from. Returns
    the labels."""
    folder = root / "CIFAR-10-C"
    folder.mkdir(parents=True, exist_ok=True)
    block = np.random.default_rng(seed).permutation(np.arange(per_severity) % 10).astype(np.uint8)
    labels = np.tile(block, 5)
    np.save(folder / "labels.npy", labels)
    rows = np.arange(len(labels))
    for k, name in enumerate(corruptions):
        images = fake_images(len(labels), (32, 32, 3), seed=seed + k + 1)
        images[:, 0, 0] = np.stack([rows % 256, rows // 256, np.full_like(rows, k)], axis=1)
        np.save(folder / f"{name}.npy", images)
    return labels


def write_fedbn_domains(root: Path, name: str, train: dict[str, int] | None = None, test: int = 4,
                        size: int = 12) -> dict[str, dict[str, tuple[list[str], list[str]]]]:
    """FedBN's layout for ``name`` (``office_caltech10`` or ``domainnet``) under ``root``: per domain
    ``<folder>/<domain>_{train,test}.pkl`` = (paths starting with the folder name, text labels) and
    the images at ``<folder>/<domain>/<class>/<part>_<k>.png``. ``train`` maps a domain to its train
    count (default 50 + 5 per domain index), labels cycling through the classes; the first domain's
    images are grayscale (mode L), the last's RGBA, the others RGB, each ``size`` x (``size`` + 4)
    pixels of one colour that encodes the image's row (red = k, green = 20 x class, blue = 100 for
    train and 150 for test). Returns the written lists."""
    import pickle

    from PIL import Image

    from pfl_core.data.domains import DOMAINNET, OFFICE

    spec = {"office_caltech10": OFFICE, "domainnet": DOMAINNET}[name]
    folder = root / spec.folder
    train = train or {d: 50 + 5 * g for g, d in enumerate(spec.domains)}
    written = {}
    for g, domain in enumerate(spec.domains):
        written[domain] = {}
        for part, count in (("train", train[domain]), ("test", test)):
            paths, labels = [], []
            for k in range(count):
                label = spec.classes[k % len(spec.classes)]
                rgb = np.zeros((size, size + 4, 3), dtype=np.uint8)
                rgb[..., 0], rgb[..., 1], rgb[..., 2] = k, spec.classes.index(label) * 20, 100 + 50 * (part == "test")
                image = Image.fromarray(rgb)
                if g == 0:
                    image = image.convert("L")
                elif g == len(spec.domains) - 1:
                    image = image.convert("RGBA")
                rel = Path(domain) / label / f"{part}_{k}.png"
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                image.save(folder / rel)
                paths.append(f"{spec.folder}/{rel.as_posix()}")
                labels.append(label)
            with open(folder / f"{domain}_{part}.pkl", "wb") as f:
                pickle.dump((paths, labels), f)
            written[domain][part] = (paths, labels)
    return written


def write_wav(path: Path, samples: np.ndarray, rate: int = 16000) -> None:
    """A 16-bit PCM mono WAV of float ``samples`` in [-1, 1)."""
    import wave

    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(np.clip(np.round(samples * 32768), -32768, 32767).astype("<i2").tobytes())


def write_speech_commands(root: Path, train_speakers: dict[str, int] | None = None,
                          held_speakers: dict[str, tuple[str, int]] | None = None,
                          words: tuple[str, ...] = ("yes", "no", "bed"), clip: int = 1600, noise: int = 20000,
                          seed: int = 0) -> Path:
    """Speech Commands v2's layout under ``root/speech_commands_v0.02``: ``<word>/<speaker>_nohash_<k>.wav``
    for every word and speaker (``train_speakers``: id -> utterances per word; ``held_speakers``: id ->
    (``val`` or ``test``, utterances per word), listed in ``validation_list.txt`` / ``testing_list.txt``),
    the six ``_background_noise_`` files of ``noise`` samples. Clips are ``clip`` samples of noise (the
    3rd utterance of a word half as long), at 16 kHz. Returns the dataset folder."""
    from pfl_core.data.speech_commands import FOLDER, NOISE_FILES, NOISE_FOLDER

    rng = np.random.default_rng(seed)
    folder = root / FOLDER
    train_speakers = train_speakers or {"aa000001": 6, "bb000002": 4, "cc000003": 5}
    held_speakers = held_speakers or {"dd000004": ("val", 5), "ee000005": ("test", 6), "ff000006": ("test", 4)}
    lists: dict[str, list[str]] = {"val": [], "test": []}
    for speaker, (role, count) in [*((s, ("train", c)) for s, c in train_speakers.items()), *held_speakers.items()]:
        for word in words:
            for k in range(count):
                rel = f"{word}/{speaker}_nohash_{k}.wav"
                write_wav(folder / rel, 0.1 * rng.standard_normal(clip // 2 if k == 2 else clip))
                if role != "train":
                    lists[role].append(rel)
    (folder / "validation_list.txt").write_text("\n".join(lists["val"]) + "\n")
    (folder / "testing_list.txt").write_text("\n".join(lists["test"]) + "\n")
    for name in NOISE_FILES:
        write_wav(folder / NOISE_FOLDER / name, 0.5 * rng.uniform(-1, 1, noise))
    return folder
