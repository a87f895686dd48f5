# The control plane and the node agent in one image: `pool serve --role …`, `pool agent run …`.
FROM python:3.11-slim

# bubblewrap: the agent's process runtime (sandboxed workloads in user namespaces)
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY domain ./domain
COPY schemas ./schemas
COPY bus ./bus
COPY workers ./workers
COPY client ./client
COPY cli ./cli
COPY local ./local
COPY bench ./bench
COPY chaos ./chaos
COPY projections ./projections
COPY agents ./agents
COPY gateway ./gateway
COPY sim ./sim
COPY computepool ./computepool
RUN pip install --no-cache-dir . && rm -rf /src/build

ENV POOL_HOME=/var/lib/pool
WORKDIR /var/lib/pool
ENTRYPOINT ["pool"]
CMD ["--help"]
