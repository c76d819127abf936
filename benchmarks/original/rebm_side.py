"""rebm's side of the harness: a worker process that runs rebm's Trainer step on the shared
batches and initial weights and answers the coordinator's requests (common.serve). All calls
into rebm go through rebm_adapter.

    python benchmarks/original/rebm_side.py JOB_JSON
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.original import common, rebm_adapter  # noqa: E402


class Side:
    def __init__(self, job: common.Job):
        self.job = job
        torch.set_num_threads(job.threads)
        self.settings = common.Settings(**job.settings).apply()
        self.trainer = None
        self.batches = None
        self.sampler = None

    def describe(self) -> dict:
        return {"settings": self.settings, "code": ROOT}

    def write_inputs(self) -> list:
        """The shared inputs, made in this process (so under its environment, e.g. the forced
        dispatch of `make test-dispatch`): the batches and rebm's initial weights."""
        torch.save(common.make_batches(self.job.spec, self.job.spec["steps"]),
                   self.job.batches_path)
        rebm_adapter.write_initial_weights(self.job)
        return [self.job.batches_path, self.job.weights_path]

    def _load(self, variant: str) -> None:
        self.trainer, self.config = rebm_adapter.build_trainer(self.job, variant)
        self.batches = torch.load(self.job.batches_path)

    def trajectory(self, name: str = "rebm", variant: str = "eager") -> dict:
        """The spec's steps through the Trainer's step; per-step records and final weights."""
        self._load(variant)
        records = [rebm_adapter.train_step(self.trainer, self._micro(i))
                   for i in range(self.job.spec["steps"])]
        path = os.path.join(self.job.workdir, f"{name}_final.pt")
        torch.save(rebm_adapter.final_weights(self.trainer), path)
        return {"steps": records, "final_weights": path}

    def _micro(self, index: int) -> list:
        return rebm_adapter.micro_batches(self.batches, index % len(self.batches["in_labels"]),
                                          self.job.device)

    def prepare_timing(self) -> dict:
        rebm_adapter.import_training()
        baseline = common.current_rss_mib()  # its code imported, nothing built yet
        self._load(self.job.variant)
        return {"compiled": rebm_adapter.is_compiled(self.trainer), "baseline_rss_mib": baseline,
                "memory_plan_mib": rebm_adapter.memory_plan_mib(self.trainer, self.config)}

    def time_steps(self, first: int, count: int) -> list:
        # the micro-batches are on the device before the clock starts: the loop's loader
        # prefetches them, and the original's side holds its batches on the device too
        micro = {i: self._micro(i) for i in range(first, first + count)}
        return common.time_calls(
            lambda i: rebm_adapter.train_step(self.trainer, micro[i], log_now=False),
            first, count, torch.device(self.job.device))

    def flops(self) -> float:
        """GFLOP of one step, counted by FlopCounterMode (the eager variant: a compiled graph
        hides its operations from the counter)."""
        micro = self._micro(0)
        return common.count_gflop(
            lambda: rebm_adapter.train_step(self.trainer, micro, log_now=False))

    def peak_memory(self) -> dict:
        return common.peak_memory(self.job.device)

    def gemm_gflops(self) -> float:
        return common.gemm_gflops(torch.device(self.job.device))

    # the sample pass (benchmarks/original/samples.py)
    def write_sample_inputs(self) -> list:
        """The shared seed file and the initial weights, made in this process."""
        from benchmarks.original.samples import make_seeds

        os.makedirs(self.job.workdir, exist_ok=True)
        torch.save(make_seeds(self.job.spec), rebm_adapter.seeds_path(self.job))
        rebm_adapter.write_initial_weights(self.job)
        return [rebm_adapter.seeds_path(self.job), self.job.weights_path]

    def prepare_samples(self) -> dict:
        import rebm.eval.evaluator  # noqa: F401  (imported before the baseline, as training's)

        baseline = common.current_rss_mib()
        self.sampler = rebm_adapter.build_sampler(self.job)
        return {"baseline_rss_mib": baseline,
                **rebm_adapter.sample_files_written(self.sampler[0])}

    def time_samples(self, variant: str = "rebm") -> float:
        """Seconds of one pass: "rebm" (no PNGs, rebm's default), "rebm_pngs" (keep_samples)."""
        import shutil
        import time

        evaluator, network, _ = self.sampler
        shutil.rmtree(rebm_adapter.sample_files_written(evaluator)["pngs"], ignore_errors=True)
        device = torch.device(self.job.device)
        common.sync(device)
        started = time.perf_counter()
        rebm_adapter.sample_pass(evaluator, network, pngs=variant == "rebm_pngs")
        common.sync(device)
        return time.perf_counter() - started

    def keep_samples(self) -> str:
        """Untimed: one pass that writes the PNGs (left in place for the comparison), and one
        generation pass whose float samples are kept in a file."""
        evaluator, network, _ = self.sampler
        self.time_samples("rebm_pngs")
        path = os.path.join(self.job.workdir, "rebm_samples.pt")
        torch.save(rebm_adapter.generated_samples(evaluator, network), path)
        return path


def main() -> None:
    channel = common.protocol_stdout()
    side = Side(common.Job.from_json(sys.argv[1]))
    common.serve({name: getattr(side, name) for name in (
        "describe", "write_inputs", "trajectory", "prepare_timing", "time_steps",
        "flops", "peak_memory", "gemm_gflops", "write_sample_inputs", "prepare_samples",
        "time_samples", "keep_samples")}, channel)


if __name__ == "__main__":
    main()
