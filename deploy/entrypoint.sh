#!/bin/sh
# The image's entry point: TensorFlow Serving's image conventions, then the server with every
# argument passed on (so `docker run IMAGE --flag ...` appends flags, TF Serving's spelling or ours).
#
# As in TF Serving's image, the model at ${MODEL_BASE_PATH:-/models}/${MODEL_NAME:-model} is served as
# ${MODEL_NAME} - when MODEL_NAME is set or that folder exists, and nothing else says which models
# to serve: a model flag among the arguments, or MIRRORSERVE_MODEL_BASE_PATH,
# MIRRORSERVE_MODEL_CONFIG_FILE or MIRRORSERVE_MODEL_REPOSITORY (ours win). Otherwise the built-in
# demo model is served.
set -eu

chosen=""
for arg in "$@"; do
  case "$arg" in
    --model_config_file*|--model-config-file*|--model_base_path*|--model-base-path*|--model-repository*) chosen=1 ;;
  esac
done
if [ -n "${MIRRORSERVE_MODEL_BASE_PATH:-}${MIRRORSERVE_MODEL_CONFIG_FILE:-}${MIRRORSERVE_MODEL_REPOSITORY:-}" ]; then
  chosen=1
fi
name="${MODEL_NAME:-model}"
base="${MODEL_BASE_PATH:-/models}"
if [ -z "$chosen" ] && { [ -n "${MODEL_NAME:-}" ] || [ -d "$base/$name" ]; }; then
  set -- "--model_name=$name" "--model_base_path=$base/$name" "$@"
fi
exec python -m server "$@"
