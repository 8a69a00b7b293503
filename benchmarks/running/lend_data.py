"""Datasets for a GPU lend, in parts that each fit one call: ``python -m benchmarks.running.lend_data``.

A lend's call carries at most 64 MiB (the checkout included), and the lent machine has no datasets
and no network. MNIST fits one call gzipped; CIFAR-10 (178 MiB of pickles) does not fit in any
lossless form. A warm lent machine keeps the ignored folders of earlier calls, so the data travels
in parts, one a call, and is put back together by the last call before the runs:

``pack``
    compresses each file of the named dataset folders (xz with a delta filter over 32 bytes, one
    image row of a CIFAR plane: 69% of the raw size on CIFAR-10, where plain xz gives 75% and gzip
    92%), cuts the compressed bytes into pieces and fills ``part1``, ``part2``, ... of at most
    ``--part-mib`` each. Every part holds the same ``manifest.json``: each file's relative path,
    size, MD5 and pieces. It prints the calls to make.
``unpack``
    (on the lent machine, in the last call) checks that every part arrived, joins the pieces,
    decompresses and writes each file under ``--data-dir``, and refuses in one line a missing part,
    a missing piece or a file whose MD5 differs. The files come out byte-identical, so a dataset's
    own checks (:mod:`pfl_core.data.cifar_files`: the official archive or a known reconstruction)
    recognise them as they would at home.

Standard library only: it runs in the lent image as it is.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import sys
from pathlib import Path

MANIFEST = "manifest.json"
FILTERS = [{"id": lzma.FILTER_DELTA, "dist": 32}, {"id": lzma.FILTER_LZMA2, "preset": 6}]
"""xz: a delta filter over 32 bytes (the pixel above, in a CIFAR plane of 32 x 32), then LZMA2 at
preset 6; measured on the first 6 MB of CIFAR-10's ``data_batch_1``: 69.0% of the raw size (plain
xz -6: 75.6%, gzip -9: 92.2%)."""
PART_MIB = 44
"""Default part size (a harness choice): 64 MiB a call less 20 MiB for the checkout, which travels
with every call (8 MiB of tracked files today)."""
CALL_MIB = 64


class LendDataError(Exception):
    """One line: what is wrong with the parts and what to do."""


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def _files(data_dir: Path, folders: list[str]) -> list[Path]:
    out = []
    for folder in folders:
        root = data_dir / folder
        if not root.is_dir():
            raise LendDataError(f"no folder {root}: name dataset folders relative to --data-dir "
                                f"(e.g. cifar-10-batches-py, MNIST/raw)")
        out += sorted(p for p in root.rglob("*") if p.is_file())
    return out


def pack(data_dir: Path, folders: list[str], out: Path, part_mib: float = PART_MIB) -> dict:
    """Compress ``folders`` (relative to ``data_dir``) into ``out/part<k>/``; returns the manifest."""
    limit = int(part_mib * 2**20)
    entries, parts, used = [], [[]], 0
    for path in _files(data_dir, folders):
        raw = path.read_bytes()
        packed = lzma.compress(raw, format=lzma.FORMAT_XZ, filters=FILTERS)
        rel = path.relative_to(data_dir).as_posix()
        pieces = []
        offset = 0
        while offset < len(packed):
            if used >= limit:
                parts.append([])
                used = 0
            take = min(limit - used, len(packed) - offset)
            piece = f"{rel}.xz.{len(pieces):03d}"
            parts[-1].append((piece, packed[offset:offset + take]))
            pieces.append({"name": piece, "part": len(parts), "md5": _md5(packed[offset:offset + take])})
            offset += take
            used += take
        entries.append({"path": rel, "size": len(raw), "md5": _md5(raw), "pieces": pieces})
    manifest = {"parts": len(parts), "part_mib": part_mib, "files": entries}
    for k, content in enumerate(parts, start=1):
        folder = out / f"part{k}"
        for piece, data in content:
            target = folder / piece
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def unpack(parts_dir: Path, data_dir: Path) -> dict:
    """Join, decompress and check every file of the parts under ``parts_dir`` into ``data_dir``."""
    found = sorted(parts_dir.glob(f"part*/{MANIFEST}"))
    if not found:
        raise LendDataError(f"no part under {parts_dir}: carry {parts_dir}/part<k> with the calls")
    manifest = json.loads(found[0].read_text())
    for k in range(1, manifest["parts"] + 1):
        if not (parts_dir / f"part{k}" / MANIFEST).is_file():
            raise LendDataError(f"part {k} of {manifest['parts']} is not here ({parts_dir / f'part{k}'}): carry "
                                f"it in an earlier call on the same warm machine (docs/gpu-and-cluster.md)")
    for entry in manifest["files"]:
        chunks = []
        for piece in entry["pieces"]:
            path = parts_dir / f"part{piece['part']}" / piece["name"]
            if not path.is_file():
                raise LendDataError(f"{path} is missing from part {piece['part']}: pack and carry it again")
            chunks.append(path.read_bytes())
        try:
            raw = lzma.decompress(b"".join(chunks), format=lzma.FORMAT_XZ)
        except lzma.LZMAError as exc:
            raise LendDataError(f"{entry['path']}: its pieces do not decompress ({exc}): pack and carry "
                                f"the parts again") from None
        if _md5(raw) != entry["md5"] or len(raw) != entry["size"]:
            raise LendDataError(f"{entry['path']}: MD5 {_md5(raw)} after unpacking, the manifest says "
                                f"{entry['md5']}: pack and carry the parts again")
        target = data_dir / entry["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(raw)
    return manifest


def calls(manifest: dict, parts_dir: str) -> str:
    """The device calls that bring the parts over, one part a call (the last one then runs)."""
    n = manifest["parts"]
    lines = [f"{n} part(s); one device call each, on the same warm machine (its idle wait is short):"]
    for k in range(1, n + 1):
        what = ("then, in the same command, `python3 -m benchmarks.running.lend_data unpack "
                f"{parts_dir} --data-dir .lend/data && ...` (the lend)") if k == n else "command `true`"
        lines.append(f"  call {k}: carry [\"{parts_dir}/part{k}\"], {what}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.running.lend_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="compress dataset folders into parts of at most --part-mib")
    p.add_argument("folders", nargs="+", help="dataset folders relative to --data-dir, e.g. cifar-10-batches-py")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", default=".lend/parts")
    p.add_argument("--part-mib", type=float, default=PART_MIB)
    u = sub.add_parser("unpack", help="join and check the parts into --data-dir (on the lent machine)")
    u.add_argument("parts_dir")
    u.add_argument("--data-dir", default=".lend/data")
    args = parser.parse_args(argv)
    try:
        if args.verb == "pack":
            manifest = pack(Path(args.data_dir), args.folders, Path(args.out), args.part_mib)
            sizes = [sum(f.stat().st_size for f in (Path(args.out) / f"part{k}").rglob("*") if f.is_file())
                     for k in range(1, manifest["parts"] + 1)]
            print(f"packed {len(manifest['files'])} files "
                  f"({sum(e['size'] for e in manifest['files']) / 2**20:.1f} MiB) into {args.out}: "
                  + ", ".join(f"part{k} {s / 2**20:.1f} MiB" for k, s in enumerate(sizes, start=1)))
            print(calls(manifest, args.out))
        else:
            manifest = unpack(Path(args.parts_dir), Path(args.data_dir))
            print(f"unpacked {len(manifest['files'])} files from {manifest['parts']} part(s) into "
                  f"{args.data_dir}, every MD5 as packed")
    except LendDataError as exc:
        print(f"lend_data: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
