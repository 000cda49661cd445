# CPU image: the torch runtime, CLI and bench. Build from the repo root:
#   docker build -f docker/cpu.Dockerfile -t dflash-trt:cpu .
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/dflash-trt
COPY . .
RUN make install && ln -s /opt/dflash-trt/.venv/bin/dflash-trt /usr/local/bin/dflash-trt
ENTRYPOINT ["dflash-trt"]
CMD ["--help"]
