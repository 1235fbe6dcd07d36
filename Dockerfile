# kvevent-subscriber image: `docker build -t kvevent-subscriber .`
# Build stage: the workspace's locked dependencies; libzmq is built from source by zmq-sys
# and linked statically, so the binary needs only glibc, libgcc and libstdc++ at run time.
FROM rust:1.95-bookworm AS build
# `--version` names the commit: `docker build --build-arg GIT_COMMIT=$(git rev-parse --short=12 HEAD) .`
ARG GIT_COMMIT=unknown
ENV KVEVENT_GIT_COMMIT=$GIT_COMMIT
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvevent-subscriber \
 && cp target/release/kvevent-subscriber /kvevent-subscriber \
 && /kvevent-subscriber --version

# Run stage: distroless (glibc, libgcc, libstdc++, CA certificates; no shell), non-root.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /kvevent-subscriber /usr/local/bin/kvevent-subscriber
COPY LICENSE NOTICE /usr/share/doc/kvevent/
USER nonroot:nonroot
EXPOSE 9095
ENTRYPOINT ["/usr/local/bin/kvevent-subscriber"]
