"""``python benchmarks/embed_load.py``: a steady embedder load, for interference checks.

MiniLM (the packaged embedder) forward passes of 32 x 64 tokens on one torch thread, forever,
printing items/s every 10 s. Put it on a core with ``taskset -c N`` beside an engine pinned to
another (benchmarks/PEERS.md, "Where the CPU goes with both at once": whether the work on
the other core, not the CPU share, slows vLLM's steps).
"""

import time

import torch
from transformers import AutoModel

from carpool.models import resolve_model_source


def main() -> None:
    torch.set_num_threads(1)
    model = AutoModel.from_pretrained(resolve_model_source("packaged:all-MiniLM-L6-v2")).eval()
    ids = torch.randint(1000, 20000, (32, 64))
    items, started = 0, time.time()
    with torch.inference_mode():
        while True:
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
            items += 32
            if time.time() - started > 10:
                print(f"{items / (time.time() - started):.1f} items/s", flush=True)
                items, started = 0, time.time()


if __name__ == "__main__":
    main()
