"""Builds accrue_client with its gRPC stubs generated from the repository's
proto (../../proto/accrue/v1/accrue.proto) by grpc_tools at build time.

The proto is compiled as `accrue_client/v1/accrue.proto`, so the generated
modules import each other as `accrue_client.v1.*`; the wire names
(`accrue.v1.JobService`) come from the proto's own package and are
unchanged.
"""

import os
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join(HERE, "..", "..", "proto", "accrue", "v1", "accrue.proto")


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        if not os.path.exists(PROTO):
            raise SystemExit(
                f"accrue-client: {PROTO} not found; build from the accrue repository "
                "(pip install ./clients/python)"
            )
        from grpc_tools import protoc
        import grpc_tools

        out = os.path.join(self.build_lib)
        with tempfile.TemporaryDirectory() as inc:
            dst = os.path.join(inc, "accrue_client", "v1")
            os.makedirs(dst)
            shutil.copy(PROTO, os.path.join(dst, "accrue.proto"))
            well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
            rc = protoc.main(
                [
                    "grpc_tools.protoc",
                    f"-I{inc}",
                    f"-I{well_known}",
                    f"--python_out={out}",
                    f"--grpc_python_out={out}",
                    os.path.join(dst, "accrue.proto"),
                ]
            )
            if rc != 0:
                raise SystemExit(f"accrue-client: protoc failed ({rc}) on {PROTO}")
        init = os.path.join(out, "accrue_client", "v1", "__init__.py")
        with open(init, "w") as f:
            f.write("# Generated at build time from proto/accrue/v1/accrue.proto.\n")


setup(cmdclass={"build_py": BuildWithStubs})
