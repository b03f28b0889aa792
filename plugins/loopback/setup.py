"""Builds the optional C batch-copy helper; without a compiler the plugin falls back to Python."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "xferkit_loopback._batchcopy",
            ["xferkit_loopback/_batchcopy.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
