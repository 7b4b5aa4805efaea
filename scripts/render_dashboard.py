"""Renders docs/grafana/tandem-dashboard.png from a real run: a store, two engines and a gateway
serve a mixed workload (shared prefixes, checkpointed streams, one engine killed and replaced)
while a real Prometheus scrapes their /metrics; each panel of the dashboard JSON is then drawn
from Prometheus's answers to that panel's own queries.

Grafana has no package on the machines we build on, so matplotlib draws the panels (title,
queries, legends and units from the JSON) instead of Grafana's renderer.

    apt-get install prometheus          # Debian's package: /usr/bin/prometheus
    python -m venv /tmp/render && /tmp/render/bin/pip install matplotlib grpcio protobuf numpy rich
    PYTHONPATH=.:clients/python /tmp/render/bin/python scripts/render_dashboard.py \
        [--seconds 180] [--out docs/grafana/tandem-dashboard.png]

The servers are this checkout's console scripts (.venv/bin, from `make test` or `make run`).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".venv" / "bin"
DASHBOARD = ROOT / "docs" / "grafana" / "tandem-dashboard.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: list[str], log: Path) -> subprocess.Popen[str]:
    """A server from .venv/bin, once it prints its listening line."""
    proc = subprocess.Popen(
        [str(BIN / args[0]), *args[1:]],
        stdout=subprocess.PIPE,
        stderr=log.open("a"),
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if " listening on " not in line:
        raise SystemExit(f"{args[0]} did not start: {line!r}; see {log}")
    return proc


def workload(gateway: str, until: float, seed: int) -> None:
    """Streams through the gateway: shared system prefixes (prefix hits), checkpoints."""
    from tandem_client import EngineClient
    from tandem_client.errors import TandemError

    rng = random.Random(seed)
    prefixes = [[(i * 7 + p * 131) % 700 + 30 for i in range(200)] for p in range(3)]
    with EngineClient(gateway) as client:
        n = 0
        while time.monotonic() < until:
            prompt = rng.choice(prefixes) + [rng.randrange(30, 700) for _ in range(8)]
            try:
                client.generate(
                    prompt,
                    max_tokens=rng.choice([16, 32, 64]),
                    ignore_eos=True,
                    request_id=f"w{seed}-{n}",
                    checkpoint_interval=16,
                )
            except TandemError:
                time.sleep(0.2)
            n += 1


def query_range(prom: str, expr: str, start: float, end: float) -> list[dict[str, object]]:
    params = urllib.parse.urlencode(
        {"query": expr.replace("$__rate_interval", "30s"), "start": start, "end": end, "step": 5}
    )
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{params}", timeout=30) as reply:
        answer = json.load(reply)
    result: list[dict[str, object]] = answer["data"]["result"]
    return result


def render(prom: str, start: float, end: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) // 8
    fig, axes = plt.subplots(rows, 2, figsize=(16, 3.2 * rows), squeeze=False)
    for panel in panels:
        ax = axes[panel["gridPos"]["y"] // 8][panel["gridPos"]["x"] // 12]
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.set_title(panel["title"] + (f"  [{unit}]" if unit else ""), fontsize=10)
        for target in panel["targets"]:
            for series in query_range(prom, target["expr"], start, end):
                values = series["values"]
                assert isinstance(values, list)
                xs = [float(t) - start for t, _ in values]
                ys = [float(v) for _, v in values]
                label = target.get("legendFormat", "")
                metric = series.get("metric")
                if isinstance(metric, dict):
                    for name, value in metric.items():
                        label = label.replace("{{" + name + "}}", str(value))
                ax.plot(xs, ys, label=label or target["expr"][:40])
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.tick_params(labelsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("Tandem dashboard (docs/grafana/tandem-dashboard.json) from a real run", y=1.0)
    fig.tight_layout()
    fig.savefig(out, dpi=80, bbox_inches="tight")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=180)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "grafana" / "tandem-dashboard.png")
    a = p.parse_args()
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        raise SystemExit("needs Prometheus: apt-get install prometheus")
    work = Path(tempfile.mkdtemp(prefix="tandem-dashboard-"))
    log = work / "servers.log"
    ports = {name: free_port() for name in ("store", "engine0", "engine1", "gateway", "prom")}
    store_port = free_port()
    procs = [
        start(
            [
                "tandem-store",
                "--data-dir",
                str(work / "store"),
                "--listen",
                f"127.0.0.1:{store_port}",
                "--metrics-listen",
                f"127.0.0.1:{ports['store']}",
            ],
            log,
        )
    ]
    engine_args = {}
    engines = []
    for name in ("engine0", "engine1"):
        port = free_port()
        engine_args[name] = [
            "tandem-engine", "--data-dir", str(ROOT / ".tandem"), "--store",
            f"127.0.0.1:{store_port}", "--listen", f"127.0.0.1:{port}",
            "--metrics-listen", f"127.0.0.1:{ports[name]}",
        ]  # fmt: skip
        procs.append(start(engine_args[name], log))
        engines.append(f"127.0.0.1:{port}")
    gateway_grpc = free_port()
    procs.append(
        start(
            ["tandem-gateway", *[x for e in engines for x in ("--engine", e)],
             "--grpc-listen", f"127.0.0.1:{gateway_grpc}", "--http-listen", "",
             "--metrics-listen", f"127.0.0.1:{ports['gateway']}"],
            log,
        )
    )  # fmt: skip
    config = work / "prometheus.yml"
    targets = [f"127.0.0.1:{ports[n]}" for n in ("store", "engine0", "engine1", "gateway")]
    config.write_text(
        "global: {scrape_interval: 2s}\n"
        f"scrape_configs: [{{job_name: tandem, static_configs: [{{targets: {targets}}}]}}]\n"
    )
    prom_proc = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{ports['prom']}"],
        stdout=subprocess.DEVNULL, stderr=(work / "prometheus.log").open("w"),
    )  # fmt: skip
    prom = f"http://127.0.0.1:{ports['prom']}"
    try:
        time.sleep(5)
        begin = time.time()
        until = time.monotonic() + a.seconds
        workers = [
            threading.Thread(target=workload, args=(f"127.0.0.1:{gateway_grpc}", until, s))
            for s in range(6)
        ]
        for w in workers:
            w.start()
        time.sleep(a.seconds / 2)
        procs[1].kill()  # engine0 dies under load: the gateway fails its streams over
        procs[1].wait()
        time.sleep(10)
        procs[1] = start(engine_args["engine0"], log)
        for w in workers:
            w.join()
        time.sleep(6)  # a last scrape or two
        render(prom, begin - 10, time.time(), a.out)
        print(a.out)
    finally:
        prom_proc.terminate()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in [prom_proc, *procs]:
            proc.wait(60)


if __name__ == "__main__":
    main()
