# The versions of the stack, in one place. Sourced by the setup scripts.
# The frameworks are pinned by default (what CI and the README's numbers use) and can be overridden
# from the environment: `TORCH_VERSION=2.15.0 make setup`, `TF_VERSION=2.20.0 make setup` (tf_keras then
# follows TensorFlow's minor version unless TF_KERAS_VERSION says otherwise). The range the package
# supports is in pyproject.toml's optional dependencies; `make check-newest` runs the newest torch.
PY_TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PY_TF_VERSION="${TF_VERSION:-2.21.0}"
if [ -n "${TF_KERAS_VERSION:-}" ]; then
    PY_TF_KERAS_VERSION="$TF_KERAS_VERSION"
elif [ -n "${TF_VERSION:-}" ]; then
    PY_TF_KERAS_VERSION="${TF_VERSION%.*}.*"
else
    PY_TF_KERAS_VERSION=2.21.0
fi
HOROVOD_VERSION=0.28.1
