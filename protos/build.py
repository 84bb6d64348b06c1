"""Compile the .proto sources in this folder into Python modules beside them.

Our protos import TensorFlow's own `tensor.proto`, `meta_graph.proto` and `error_codes.proto`. The TensorFlow wheel
ships only their compiled modules, not the sources, so we hand protoc the descriptors that the
installed TensorFlow registers at run time (`--descriptor_set_in`). The generated code then binds
to exactly the message definitions the server process uses, and nothing is copied.

Sources: protos/tensorflow_serving (TF Serving's API and config) and protos/inference (the Open
Inference Protocol). Usage: `python -m protos.build` regenerates; `python -m protos.build --check` exits 1 when the
committed modules differ from what the pinned grpcio-tools would generate now.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tensorflow_serving", "inference")
"""Folders of protos/ holding .proto sources, each compiled into modules beside them."""
SOURCES = sorted(p for package in PACKAGES for p in (ROOT / "protos" / package).glob("*.proto"))
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _tensorflow_descriptor_set() -> bytes:
    """Serialize the installed TensorFlow's descriptors for the files our protos import."""
    from tensorflow.core.framework import tensor_pb2
    from tensorflow.core.protobuf import error_codes_pb2, meta_graph_pb2

    seen: dict[str, FileDescriptor] = {}

    def visit(fd: FileDescriptor) -> None:
        if fd.name in seen:
            return
        for dep in fd.dependencies:
            visit(dep)
        seen[fd.name] = fd

    visit(tensor_pb2.DESCRIPTOR)
    visit(meta_graph_pb2.DESCRIPTOR)
    visit(error_codes_pb2.DESCRIPTOR)
    fds = descriptor_pb2.FileDescriptorSet()
    for fd in seen.values():
        fd.CopyToProto(fds.file.add())
    return bytes(fds.SerializeToString())


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over SOURCES, writing modules under out_dir/protos/<package>."""
    import grpc_tools
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        descriptor_set = Path(tmp) / "tensorflow.pb"
        descriptor_set.write_bytes(_tensorflow_descriptor_set())
        args = [
            "protoc",
            f"--proto_path={ROOT}",
            f"--descriptor_set_in={descriptor_set}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            *(str(p.relative_to(ROOT)) for p in SOURCES),
        ]
        # Well-known types (any, wrappers) come from grpc_tools' bundled include folder.
        args.insert(2, f"--proto_path={Path(grpc_tools.__file__).parent / '_proto'}")
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
    return sorted(p for package in PACKAGES for p in (out_dir / "protos" / package).iterdir()
                  if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args(argv)
    if not args.check:
        written = generate(ROOT)
        print(f"generated {len(written)} files under protos/{{{','.join(PACKAGES)}}}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.relative_to(tmp).as_posix(): p for p in generate(Path(tmp))}
        committed = {p.relative_to(ROOT).as_posix(): p for package in PACKAGES
                     for p in (ROOT / "protos" / package).iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
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
