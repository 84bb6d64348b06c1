"""Compile the .proto sources in this folder into Python modules beside them, and copy the
TensorFlow protos they import into protos/tf, so the serving process never imports TensorFlow.

Our protos import TensorFlow's own `tensor.proto`, `meta_graph.proto`, `error_codes.proto` and
`example.proto`. The TensorFlow wheel ships only their compiled modules, not the sources, so we
hand protoc the exact descriptors the installed TensorFlow embeds (`--descriptor_set_in`) and have
it generate Python modules for them too, under protos/tf/<their path>, imports rewritten to point
there.

Why whole files, byte-identical, rather than a trimmed copy of the few messages we use: a process
that loads both TensorFlow's modules and ours (the test suite, a user's notebook) shares one
protobuf descriptor pool, which accepts a file registered twice only when both copies are
identical; any other copy of `tensorflow.TensorProto` is a "duplicate symbol" error. Identical files
also keep the wire format identical by construction.

Sources: protos/tensorflow_serving (TF Serving's API and config) and protos/inference (the Open
Inference Protocol). Usage: `python -m protos.build` regenerates; `python -m protos.build --check`
exits 1 when the committed modules differ from what the pinned grpcio-tools would generate now.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tensorflow_serving", "inference")
"""Folders of protos/ holding .proto sources, each compiled into modules beside them."""
SOURCES = sorted(p for package in PACKAGES for p in (ROOT / "protos" / package).glob("*.proto"))
COPIED = "tf"
"""protos/tf: the TensorFlow protos our sources import, with everything they import in turn."""
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
COPIED_PREFIXES = ("tensorflow", "xla")
"""Top-level proto folders of TensorFlow's files (tsl's error codes live under xla/)."""
_IMPORT = re.compile(rf"^(from|import) ({'|'.join(COPIED_PREFIXES)})\.", re.MULTILINE)


def _tensorflow_files() -> list[descriptor_pb2.FileDescriptorProto]:
    """TensorFlow's descriptors for the files our protos import, dependencies first, exactly as
    the installed TensorFlow registers them."""
    from tensorflow.core.example import example_pb2
    from tensorflow.core.framework import tensor_pb2
    from tensorflow.core.protobuf import error_codes_pb2, meta_graph_pb2

    seen: dict[str, FileDescriptor] = {}

    def visit(fd: FileDescriptor) -> None:
        if fd.name in seen:
            return
        for dep in fd.dependencies:
            visit(dep)
        seen[fd.name] = fd

    for module in (tensor_pb2, meta_graph_pb2, error_codes_pb2, example_pb2):
        visit(module.DESCRIPTOR)
    return [descriptor_pb2.FileDescriptorProto.FromString(fd.serialized_pb) for fd in seen.values()]


def _rewrite_imports(path: Path) -> None:
    """Point generated imports of TensorFlow's modules at our copies under protos/tf."""
    text = path.read_text()
    path.write_text(_IMPORT.sub(rf"\1 protos.{COPIED}.\2.", text))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over SOURCES and TensorFlow's files, writing modules under out_dir/protos/."""
    import grpc_tools
    from grpc_tools import protoc

    files = _tensorflow_files()
    copied = [f.name for f in files if f.name.split("/")[0] in COPIED_PREFIXES]
    with tempfile.TemporaryDirectory() as tmp:
        descriptor_set = Path(tmp) / "tensorflow.pb"
        descriptor_set.write_bytes(descriptor_pb2.FileDescriptorSet(file=files).SerializeToString())
        raw = Path(tmp) / "out"
        raw.mkdir()
        args = [
            "protoc",
            f"--proto_path={ROOT}",
            # Well-known types (any, wrappers) come from grpc_tools' bundled include folder.
            f"--proto_path={Path(grpc_tools.__file__).parent / '_proto'}",
            f"--descriptor_set_in={descriptor_set}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            *(str(p.relative_to(ROOT)) for p in SOURCES),
            *copied,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        grpc_args = [a for a in args if not a.startswith(("--python_out", "--pyi_out"))
                     and a not in copied] + [f"--grpc_python_out={raw}"]
        if protoc.main(grpc_args) != 0:
            raise SystemExit("protoc failed")
        for prefix in COPIED_PREFIXES:
            shutil.move(raw / prefix, raw / "protos" / COPIED / prefix)
        written = sorted(p for p in (raw / "protos").rglob("*") if p.name.endswith(GENERATED_SUFFIXES))
        for folder in {p.parent for p in written if COPIED in p.relative_to(raw / "protos").parts[:1]}:
            for package in (folder, *folder.parents):
                if package == raw / "protos":
                    break
                (package / "__init__.py").touch()
        for path in written:
            _rewrite_imports(path)
        for path in (raw / "protos").rglob("*"):
            if path.is_file():
                target = out_dir / path.relative_to(raw)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
    return _generated(out_dir)


def _generated(root: Path) -> list[Path]:
    found = [p for package in PACKAGES for p in (root / "protos" / package).iterdir()
             if p.name.endswith(GENERATED_SUFFIXES)]
    copied = root / "protos" / COPIED
    if copied.is_dir():
        found += [p for p in copied.rglob("*.py*") if p.name.endswith(GENERATED_SUFFIXES) or p.name == "__init__.py"]
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args(argv)
    if not args.check:
        shutil.rmtree(ROOT / "protos" / COPIED, ignore_errors=True)
        written = generate(ROOT)
        print(f"generated {len(written)} files under protos/{{{','.join((*PACKAGES, COPIED))}}}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.relative_to(tmp).as_posix(): p for p in generate(Path(tmp))}
        committed = {p.relative_to(ROOT).as_posix(): p for p in _generated(ROOT)}
        stale = [name for name, p in fresh.items()
                 if name not in committed or not filecmp.cmp(p, committed[name], shallow=False)]
        extra = sorted(set(committed) - set(fresh))
        if stale or extra:
            print(f"generated protos are stale: differ={stale} extra={extra}; run `make protos`")
            return 1
    print("generated protos are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
