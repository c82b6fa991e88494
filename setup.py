"""The one compiled piece: the copy engine's block copy (tiers/_copyrows.c).

Optional: where no C compiler is found the install goes on without it and the
copy engine copies with ctypes.memmove instead (same bytes, slower on small
blocks; ``kvstore.tiers.copy_engine.NATIVE`` says which one a process uses).
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore.tiers._copyrows",
            sources=["tiers/_copyrows.c"],
            extra_compile_args=["-O2", "-std=c11"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
