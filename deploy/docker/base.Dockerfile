# A stand-in for python:3.11-slim on Debian bookworm's own python3.11: see build-base.sh.
ARG ROOTFS
FROM ${ROOTFS}
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
ENV LANG=C.UTF-8 \
    PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN python3.11 -m venv /opt/python && python --version && pip --version
CMD ["python3"]
