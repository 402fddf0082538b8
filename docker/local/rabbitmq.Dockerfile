# Stand-in for rabbitmq:4.1-management, built by scripts/compose-images.sh from
# Debian trixie's rabbitmq-server (4.0) with the management plugin enabled. Like
# the official image: data in /var/lib/rabbitmq (the `rabbitmq-data` volume takes
# its ownership), logs to stdout, run as the `rabbitmq` user; RABBITMQ_DEFAULT_USER
# and RABBITMQ_DEFAULT_PASS are read by the server itself.
ARG BASE_IMAGE=llmpipe-local/debian:trixie
FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends rabbitmq-server \
 && rm -rf /var/lib/apt/lists/* \
 && rabbitmq-plugins enable --offline rabbitmq_management \
 && mkdir -p /etc/rabbitmq/conf.d \
 && chown -R rabbitmq:rabbitmq /var/lib/rabbitmq /etc/rabbitmq
ENV RABBITMQ_LOGS=-
USER rabbitmq
WORKDIR /var/lib/rabbitmq
EXPOSE 5672 15672
# The server's own start script as the container's main process, which stops the broker on
# SIGTERM and writes to stdout. Debian's /usr/sbin/rabbitmq-server wrapper traps no signal
# (as PID 1 it ignored `docker stop`, which killed the broker after its 10 s) and sends the
# server's output to a file under /var/log/rabbitmq.
CMD ["/usr/lib/rabbitmq/bin/rabbitmq-server"]
