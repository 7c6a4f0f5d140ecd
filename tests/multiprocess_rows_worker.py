"""One of the two processes of tests/test_multiprocess_rows.py: joins the job once, then trains
each row's config in turn (what `jaxtrain train` does after it has joined: validate against the
devices, then train), so that seven rows pay for one start-up and one coordinator.

    python tests/multiprocess_rows_worker.py SPEC.json PROCESS_ID

SPEC.json: {"coordinator": "127.0.0.1:PORT", "devices": 4, "rows": {id: [overrides...]}}. A row
that fails writes its traceback to ERROR in its output_dir and the next row starts (its peer
fails the same way: the same config on the same mesh)."""

import json
import os
import sys
import traceback


def main(spec_path: str, process_id: int) -> int:
    spec = json.load(open(spec_path))
    from jaxtrain import host
    from jaxtrain.config import DistributedConfig, load_config, validate
    from jaxtrain.recovery import distributed

    host.configure_host(spec["devices"])
    distributed.initialize(
        DistributedConfig(
            coordinator_address=spec["coordinator"],
            num_processes=2,
            process_id=process_id,
            initialization_timeout=60,
        )
    )
    import jax

    from jaxtrain.trainer import train

    for row, overrides in spec["rows"].items():
        cfg = load_config(spec["config"], [*overrides, f"distributed.process_id={process_id}"])
        try:
            validate(cfg, num_devices=jax.device_count())
            train(cfg)
        except Exception:  # noqa: BLE001 - reported to the test, which names the row
            os.makedirs(cfg.output_dir, exist_ok=True)
            with open(os.path.join(cfg.output_dir, f"ERROR.{process_id}"), "w") as f:
                f.write(traceback.format_exc())
            print(f"row {row} failed", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
