"""The answers this project was generated with. Defaults elsewhere read them from here, and only here."""

PROJECT_NAME = {{cookiecutter.project_name | py_str}}
BACKEND = {{cookiecutter.backend | py_str}}  # auto = nccl when CUDA is available, else gloo
USE_WANDB = {{cookiecutter.use_wandb == "yes"}}
WANDB_PROJECT = {{cookiecutter.wandb_project | py_str}}
DEBUG_PORT = {{cookiecutter.debug_port | int}}  # rank with local rank N listens on DEBUG_PORT + N
NPROC_PER_NODE = {{cookiecutter.nproc_per_node | int}}
