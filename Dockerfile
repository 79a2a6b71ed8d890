# The serving image: a base with Python + vLLM (a pinned vLLM image, or the tiny profile's local
# debootstrap base) plus the quantized model, the baked compile cache and the serving code.
# Built by scripts/build_image.py from a staged context holding model/ cache/ serving/ serve.json.
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

# Largest and least often changed first, so a code change rebuilds only the small layers.
COPY model/ /opt/ml/model/
COPY cache/ /opt/ml/cache/
COPY serving/ /opt/ml/code/serving/
COPY serve.json /opt/ml/serve.json

EXPOSE 8080
ENTRYPOINT ["python3", "-m", "serving"]
