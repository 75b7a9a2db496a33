#!/usr/bin/env python3
"""Generate the kubelet API Python stubs from proto/ (grpcio-tools): the device plugin API v1beta1 and
the PodResources API v1.

    python hack/gen_proto.py           # (re)write src/gpupool_deviceplugin/api/<api>/api_pb2*.py
    python hack/gen_proto.py --check   # exit 1 if the committed stubs differ from a fresh generation
                                       # (ignoring the generator's version stamps)

protoc writes `from v1beta1 import api_pb2` into the gRPC module (the import follows the .proto path);
we rewrite it to the package path so the stubs import from anywhere.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
API_DIR = ROOT / "src" / "gpupool_deviceplugin" / "api"
# .proto paths under proto/; each one's stubs go to the same path under API_DIR
PROTO_FILES = ("v1beta1/api.proto", "podresources/v1/api.proto")
GENERATED = ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")
INIT_DOC = '"""Generated kubelet API stubs (see proto/ and hack/gen_proto.py)."""\n'


def _outputs(proto: str) -> tuple[str, str, str]:
    """(directory relative to API_DIR, the gRPC module's import as protoc writes it, as we rewrite it)."""
    folder = str(Path(proto).parent)
    module = folder.replace("/", ".")
    return folder, f"from {module} import api_pb2 as", f"from gpupool_deviceplugin.api.{module} import api_pb2 as"


def generate() -> dict[str, str]:
    """Run protoc in-process; return {path relative to API_DIR: text} after the import rewrite."""
    from grpc_tools import protoc  # dev dependency, only needed here

    include = Path(protoc.__file__).parent / "_proto"
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for proto in PROTO_FILES:
            rc = protoc.main([
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"-I{include}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                str(PROTO_ROOT / proto),
            ])
            if rc != 0:
                raise SystemExit(f"protoc failed on {proto} with exit code {rc}")
            folder, import_from, import_to = _outputs(proto)
            for name in GENERATED:
                text = (Path(tmp) / folder / name).read_text()
                out[f"{folder}/{name}"] = text.replace(import_from, import_to)
            if import_to not in out[f"{folder}/api_pb2_grpc.py"]:
                raise SystemExit(f"unexpected protoc output for {proto}: the api_pb2 import of the gRPC module "
                                 "was not found")
    return out


def _without_versions(text: str) -> str:
    """The generated code minus the generator's own version stamps, which change with grpcio-tools
    releases and not with the .proto (a contributor on another patch release is not drift)."""
    text = re.sub(r"^# Protobuf Python Version: .*$", "", text, flags=re.M)
    text = re.sub(r"ValidateProtobufRuntimeVersion\((?:.*\n)*?\)", "ValidateProtobufRuntimeVersion(...)", text)
    return re.sub(r"^GRPC_GENERATED_VERSION = .*$", "", text, flags=re.M)


def check(fresh: dict[str, str]) -> list[str]:
    """Paths of generated files whose committed copy differs from `fresh` (with a unified diff)."""
    problems = []
    for name, text in fresh.items():
        path = API_DIR / name
        committed = path.read_text() if path.exists() else ""
        if _without_versions(committed) != _without_versions(text):
            diff = difflib.unified_diff(committed.splitlines(), text.splitlines(),
                                        f"committed/{name}", f"generated/{name}", lineterm="", n=1)
            problems.append(f"{name} is out of date:\n" + "\n".join(list(diff)[:40]))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    fresh = generate()
    if args.check:
        problems = check(fresh)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("stubs drifted from proto/: run `make proto`", file=sys.stderr)
            return 1
        print("proto stubs up to date")
        return 0
    for name, text in fresh.items():
        path = API_DIR / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        for pkg in path.relative_to(API_DIR).parents:  # every package from API_DIR down to the stubs
            init = API_DIR / pkg / "__init__.py"
            if not init.exists():
                init.write_text(INIT_DOC)
    print(f"wrote {', '.join(sorted(fresh))} under {API_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
