# The serving image: a base with Python + vLLM (a pinned vLLM image, or the tiny profile's local
# debootstrap base) plus the quantized model, the baked compile cache and the serving code.
# Built by scripts/build_image.py from a staged context holding model/ cache/ serving/ serve.json, with
# `buildah bud --timestamp 0` (file times and creation date 1970: the same inputs give the same image ID).
ARG BASE
FROM ${BASE}

# Everything is read from the image: no hub, no downloads at start-up. The cache locations under
# /opt/ml/cache are set by serving/launch.py (the bake uses the same code), not here.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
# Keep the base's PYTHONPATH (the tiny base puts its site-packages there; vLLM's image has none).
ENV PYTHONPATH=/opt/ml/code${PYTHONPATH:+:${PYTHONPATH}}

# Least privilege: the server runs as an unprivileged user (uid 1000, no passwd entry needed). The model, code and
# settings stay root's, read-only to it; the compile cache is its own (vLLM and torch.compile may add to it), and
# HOME is /tmp for any library that writes under ~ (/tmp is world-writable in both bases). USER names it for
# getpass.getuser(), which torch's inductor calls at import and which fails for a uid with no passwd entry.
ENV HOME=/tmp \
    USER=serving \
    LOGNAME=serving
# Largest and least often changed first: Docker's own builder (image.reproducible: false) then rebuilds only the
# small layers after a code change. buildah (the reproducible default) commits them all as one layer.
COPY model/ /opt/ml/model/
# a drafted variant's drafter (speculative.method dflash); empty otherwise
COPY draft/ /opt/ml/draft/
COPY --chown=1000:1000 cache/ /opt/ml/cache/
COPY serving/ /opt/ml/code/serving/
COPY serve.json /opt/ml/serve.json

USER 1000:1000
EXPOSE 8080
ENTRYPOINT ["python3", "-m", "serving"]

# Provenance, passed by scripts/build_image.py as --build-arg (LABEL_ARGS there names each); last, so new
# labels rebuild no layer. org.opencontainers.image.created is added only with image.label_build_date.
ARG TITLE
ARG VERSION
ARG REVISION
ARG BASE_NAME
ARG VARIANT
ARG CONFIG_SHA256
ARG RECIPE_SHA256
ARG WEIGHTS_REVISION
ARG WEIGHTS_MANIFEST_SHA256
ARG QUANTIZED_MANIFEST_SHA256
ARG VLLM_VERSION
ARG GPU_ARCH
ARG DRAFT_MANIFEST_SHA256
LABEL org.opencontainers.image.title="${TITLE}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${BASE_NAME}" \
      io.qwen35-serve.variant="${VARIANT}" \
      io.qwen35-serve.config.sha256="${CONFIG_SHA256}" \
      io.qwen35-serve.recipe.sha256="${RECIPE_SHA256}" \
      io.qwen35-serve.weights.revision="${WEIGHTS_REVISION}" \
      io.qwen35-serve.weights.manifest.sha256="${WEIGHTS_MANIFEST_SHA256}" \
      io.qwen35-serve.quantized.manifest.sha256="${QUANTIZED_MANIFEST_SHA256}" \
      io.qwen35-serve.vllm.version="${VLLM_VERSION}" \
      io.qwen35-serve.gpu_arch="${GPU_ARCH}" \
      io.qwen35-serve.draft.manifest.sha256="${DRAFT_MANIFEST_SHA256}"
