# Pinned versions of the stack, in one place. Sourced by the setup scripts.
PY_TORCH_VERSION=2.13.0
PY_TF_VERSION=2.21.0
PY_TF_KERAS_VERSION=2.21.0
HOROVOD_VERSION=0.28.1
