"""What this machine is and can build: the backend table, the probes, doctor, the release matrix.

backends holds the backend table (data/backends.toml) and the Host (os, arch); probes finds a tool and its
version; platforms/ knows how to build and run for another OS or arch (Windows, Linux arm64, the ROCm root,
OpenSSL); webui builds llama-server's web UI with Node.js; doctor turns the probes into a report per
backend; matrix lists what a release builds where. Takes a backend name or a Host; hands on table entries
and probe results as plain data.
"""
