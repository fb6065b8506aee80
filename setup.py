import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH = "fedml_perfedavg_torchvision.pth"  # makes `import fedml` work before `import fedml_perfedavg`


class BuildWithPth(build_py):
    """Ships the .pth file at the top of site-packages, beside the module it imports."""

    def run(self):
        super().run()
        shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(
    name="fedml-perfedavg",
    version="0.2.0",  # as fedml_perfedavg.__version__
    description="Per-FedAvg (personalized federated learning via meta-learning) as a FedML plugin",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fedml_perfedavg", "fedml_perfedavg.*"]),
    py_modules=["fedml_perfedavg_torchvision"],
    cmdclass={"build_py": BuildWithPth},
    python_requires=">=3.9",
    install_requires=[
        "fedml==0.9.6",
        "torch==2.13.0",
        "torchvision==0.28.0",
        # Bounds under which fedml 0.9.6 imports and runs (its own requirements leave them open).
        "numpy<2",
        "setuptools<81",
        "wandb==0.13.2",
        "requests<2.32",
        "protobuf<4",
        "paho-mqtt<2",
        "chardet<6",
        "networkx<3.0",
        "docker==6.1.3",
        "PyYAML",
        "tqdm",
    ],
    extras_require={
        "mpi": ["mpi4py", "mpich"],
        "silo": ["grpcio", "cryptography>=40", "safetensors", "pycryptodome>=3.15"],
        "bench": ["matplotlib"],
        # DP-SGD's accountants (dp_args.dp_solution_type: dpsgd); threadpoolctl keeps PRV's one BLAS
        # dot product on one thread, so every process states the same epsilon to the bit; Opacus held
        # below 1.7 (the accountants' tests ran on 1.6.0; core/accounting.py uses its public API only)
        "dp": ["opacus>=1.4,<1.7", "threadpoolctl>=3"],
        "test": ["pytest", "hypothesis", "pytest-xdist"],  # make test runs the suite on several workers
    },
    entry_points={"console_scripts": ["fedml-perfedavg = fedml_perfedavg.command:main"]},
)
