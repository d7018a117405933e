"""kserve/nginx.conf rendered for this pod: `${name}` placeholders filled from PodConfig (nginx's
own `$variables` have no braces there and pass through untouched)."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
from urllib.parse import quote

from pod.config import LARGE_BODY_BYTES, PodConfig

TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kserve", "nginx.conf")
PLACEHOLDER = re.compile(r"\$\{([a-z][a-z0-9_]*)\}")


def values(cfg: PodConfig, inference_key: str) -> dict:
    # the key goes into a header value between double quotes (kserve/nginx.conf)
    if not re.fullmatch(r"[A-Za-z0-9._~+/=-]+", inference_key):
        raise ValueError("TorchServe's inference key holds characters nginx's config cannot carry")
    return {"inference_key": inference_key, "nginx_workers": cfg.nginx_workers, "runtime_dir": cfg.runtime_dir,
            "inference_host": cfg.inference[0], "inference_port": cfg.inference[1],
            "metrics_host": cfg.metrics[0], "metrics_port": cfg.metrics[1],
            "status_port": cfg.status_port, "http_port": cfg.http_port,
            "public_metrics_port": cfg.metrics_port, "max_request_bytes": cfg.max_request_bytes,
            "response_timeout_s": cfg.response_timeout_s + 5,
            # as root (a developer's machine, not the image: it runs as uid 1000) nginx would hand
            # its workers to `nobody`, who cannot write the temporary directories made here
            "user_line": "user root;\n" if os.geteuid() == 0 else "",
            "grpc_port": cfg.grpc_port, "abort_socket": cfg.abort_socket, "bridge_port": cfg.bridge_port, "model_infer": model_infer(cfg),
            "model_map": model_map(cfg), "model_list": ", ".join(m.name for m in routable(cfg)) or "none",
            **gate_values(cfg), **ipv6_listens(cfg, ipv6_available())}


def gate_values(cfg: PodConfig) -> dict:
    """The gate's bounds on bodies by size (pod/config.py) and its refusal's words."""
    tiers = ((LARGE_BODY_BYTES, None, cfg.large_bodies),) + cfg.pool_tiers
    zones, limits = [], []
    for low, high, n in tiers:
        digits = len(str(low))  # each tier's lengths have one number of digits (or more, the first)
        assert low == 10 ** (digits - 1) and high in (None, 10 ** digits - 1), (low, high)
        zone = f"bodies_{digits}_digits"
        regex = f"^[0-9]{{{digits},}}$" if high is None else f"^[0-9]{{{digits}}}$"
        zones.append(f"    map $content_length ${zone} {{\n        \"~{regex}\" 1;\n        default \"\";\n    }}\n"
                     f"    limit_conn_zone ${zone} zone={zone}:1m;")
        limits.append(f"            limit_conn {zone} {n};")
    why = (f"the pod passes at most {cfg.large_bodies} request bodies of {LARGE_BODY_BYTES:,} bytes or more to TorchServe "
           f"at once, as many as the direct memory of its frontend holds for bodies up to {cfg.max_request_bytes} bytes "
           f"(max_request_size: {cfg.large_bodies_why}), and of smaller ones {cfg.pool_tiers_why}; as many of this "
           "size are with TorchServe now: the model is serving, retry in a second or send smaller requests")
    refusal = json.dumps({"code": 503, "type": "TooManyLargeBodies", "error": why})
    # nginx would read $ as a variable, ' as the end of the JSON's string and " as the end of why's
    if "$" in refusal or "'" in refusal or '"' in why:
        raise ValueError(f"the gate's refusal cannot hold $, ' or \": {why}")
    return {"gate_socket": cfg.gate_socket, "large_bodies": cfg.large_bodies, "large_bodies_why": cfg.large_bodies_why,
            "large_body_bytes": f"{LARGE_BODY_BYTES:,}", "pool_tiers_why": cfg.pool_tiers_why,
            "gate_zones": "\n".join(zones), "gate_limits": "\n".join(limits),
            "large_refusal": why, "large_refusal_json": refusal}


def ipv6_available() -> bool:
    """Whether this host can listen on IPv6: on an IPv6-only cluster the kubelet's probes and the
    Service's traffic reach the pod's IPv6 address, which an IPv4 listener refuses; on a host
    without IPv6, nginx fails to start on an IPv6 listener."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::", 0))
        return True
    except OSError:
        return False


def ipv6_listens(cfg: PodConfig, available: bool) -> dict:
    """Each public port's IPv6 listen line (ipv6only: its IPv4 listener stays as it is), or a
    comment where the host has no IPv6."""
    out = {}
    for key, port, extra in (("http_port_v6", cfg.http_port, " reuseport backlog=4096"),
                             ("grpc_port_v6", cfg.grpc_port, " http2 reuseport backlog=4096"),
                             ("public_metrics_port_v6", cfg.metrics_port, "")):
        out[key] = f"listen [::]:{port} ipv6only=on{extra};" if available else "# no IPv6 on this host"
    return out


# TorchServe's model names and versions are of these characters; a model named otherwise gets no
# inference route (its requests are answered 404) rather than a name spliced into nginx's config.
ROUTABLE = re.compile(r"[A-Za-z0-9._-]+")


def routable(cfg: PodConfig) -> list:
    """The models the inference routes forward to: the one rule for the map and the 404's list."""
    return [m for m in cfg.models if ROUTABLE.fullmatch(m.name) and ROUTABLE.fullmatch(m.version or "0")]


def model_map(cfg: PodConfig) -> str:
    """The map's entries: each routable model by name alone and by name and version, as a regular
    expression (~), which nginx matches case-sensitively, as TorchServe matches names."""
    lines = []
    for m in routable(cfg):
        name, version = (re.escape(x) for x in (m.name, m.version))
        lines.append(f"        \"~^{name}\\|({version})?$\" 1;")
    return "\n".join(lines)


def model_infer(cfg: PodConfig) -> str:
    """Where ModelInfer calls go: with one model, through the gate to TorchServe's predictions route for
    it (the handler refuses a request naming another model); with several, to the bridge, which
    reads each request's model name."""
    if len(cfg.models) != 1:
        return "grpc_pass grpc://grpc_bridge;"
    m = cfg.models[0]
    return (f"add_trailer grpc-status 0;\n            "
            f"proxy_pass http://gate/predictions/{quote(m.name, safe='')};")


def render(cfg: PodConfig, inference_key: str, template: str = TEMPLATE) -> str:
    with open(template) as f:
        text = f.read()
    known = values(cfg, inference_key)
    missing = sorted({m for m in PLACEHOLDER.findall(text) if m not in known})
    if missing:
        raise ValueError(f"{template} names unknown placeholders: {', '.join(missing)}")
    return PLACEHOLDER.sub(lambda m: str(known[m.group(1)]), text)


def write(cfg: PodConfig, inference_key: str) -> str:
    """Writes RUNTIME_DIR/nginx.conf (readable by its owner alone: it holds TorchServe's inference
    key) and nginx's temporary directories; returns the conf path."""
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(cfg.runtime_dir, "nginx", sub), exist_ok=True)
    path = os.path.join(cfg.runtime_dir, "nginx.conf")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        os.fchmod(f.fileno(), 0o600)  # a file an earlier start left keeps its mode otherwise
        f.write(render(cfg, inference_key))
    return path


def binary() -> str:
    """nginx from the distribution (the image installs it; `apt-get install nginx`)."""
    found = os.environ.get("NGINX") or shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)
    if not found:
        raise SystemExit("pod: error: nginx is not installed; the image installs it (kserve/Dockerfile), "
                         "here: apt-get install nginx, or set NGINX=/path/to/nginx")
    return found
