"""The demo recipe (examples/tiny_jpeg.yaml) shortened for the benchmarks' smoke tests: one
prompt of 4 samples per step, 3 denoising steps, one micro-batch, no validation."""

SHORT_DEMO = [
    "data.group_size=4",
    "data.prompts_per_step=1",
    "data.val_prompts=0",
    "sampling.num_points=4",
    "trainer.loss.micro_batch_size=4",
    "trainer.loss.mini_batches=1",
]
