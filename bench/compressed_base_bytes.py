"""What a checkpointed generation stores beside a compressed prefix record, in one run.

Two engines (in-process CheckpointManagers) on one store, each a generation of the same
prompt whose prefix is kept as a compressed record (`--bits`, `--scheme`): the first computes
the prompt (the record does not hold its bytes, so its chain starts at position 0 and its
first snapshot holds the whole prompt again, as every such generation did before); the
second restores the prompt from the record in the store and its chain rests on it. Prints
the bytes each generation's segments hold, the record's, and their ratio.

    python bench/compressed_base_bytes.py --prompt 1024 --bits 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_service.checkpoints.generation_meta import segment_key  # noqa: E402
from engine_service.checkpoints.manager import CheckpointManager, CheckpointSettings  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402
from engine_service.protocol.kv_codec import Scheme  # noqa: E402
from engine_service.protocol.requests import RecordFormat  # noqa: E402
from tandem_client import StoreClient  # noqa: E402
from tests.generation_rows import kept_generation  # noqa: E402
from tests.servers import InProcessStore  # noqa: E402


def stored_bytes(store: StoreClient, key: bytes) -> tuple[int, int]:
    """The payload bytes of a generation's segments, and the position its chain starts at."""
    reads = store.get_headers([segment_key(key, i) for i in range(64)])
    held = [r.checkpoint for r in reads if r.checkpoint is not None]
    return sum(c.payload_bytes for c in held), min(int(c.metadata["start"]) for c in held)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--scheme", choices=("affine", "turboquant"), default="affine")
    args = parser.parse_args()
    scheme = Scheme.AFFINE if args.scheme == "affine" else Scheme.TURBOQUANT
    record = RecordFormat(args.bits, scheme)
    with tempfile.TemporaryDirectory() as scratch:
        model = load_model("", Path(scratch) / "engine")
        prompt = [(j * 53) % 700 + 3 for j in range(args.prompt)]
        store = InProcessStore(Path(scratch) / "store")
        engines = [CheckpointManager(model, CheckpointSettings(store=store.address)) for _ in "ab"]
        try:
            _, computed = kept_generation(model, engines[0], prompt, 40, "computed", record=record)
            _, restored = kept_generation(model, engines[1], prompt, 40, "restored", record=record)
            with StoreClient(store.address) as client:
                (prefix,) = client.list_all(kind="prefix")
                without, start_a = stored_bytes(client, computed)
                resting, start_b = stored_bytes(client, restored)
        finally:
            for engine in engines:
                engine.close()
            store.stop()
    print(f"{record.tag} prefix record of {args.prompt} tokens: {prefix.payload_bytes:,} bytes")
    print(f"generation that computed its prompt: {without:,} bytes (chain from {start_a})")
    print(f"generation resting on the record:    {resting:,} bytes (chain from {start_b})")
    print(f"ratio: {without / resting:.1f}x fewer bytes stored a generation")


if __name__ == "__main__":
    main()
