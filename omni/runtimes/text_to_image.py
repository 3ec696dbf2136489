"""Text to image with a diffusers pipeline (Stable Diffusion and its kin).

Inputs: `prompt`, what to draw (BYTES [1]); `width` and `height` in pixels (INT32 [1],
multiples of 8; 0: the model's size); `seed` (INT64 [1], from 0): the request's own
random generator, so the same prompt and seed give the same image. Output `image`: a PNG
file (BYTES [1]).

The requests of a batch of one size share one pipeline call (the denoising steps and the
VAE's decoding run for them together), each with its own seeded generator for its
starting noise: a result does not depend on its batch-mates (on the CPU, beyond rounding
that PNG's 8 bits hide; on a GPU in float16, kernels chosen by batch size may round
differently). The GPU's part ends with the decoded pixels (`denoise`): there the handler
calls gpu_done(), and the PNG encoding (`encode`) runs on the CPU while the GPU serves the
next request. Between denoising steps it calls gpu_step(): a hotter model of its GPU
goes first there, instead of sharing the GPU with a whole batch's steps.

Weights: a model directory as diffusers saves a pipeline (`save_pretrained`: a
model_index.json and a folder per component), e.g. `hf download stabilityai/sd-turbo
--local-dir models/sd-turbo` (with steps = 1 and guidance = 0.0). Optional keys in
omni-model.toml: `steps` (denoising steps, default 30), `guidance` (classifier-free
guidance scale, default 7.5), `width` and `height` (default the pipeline's own size),
`max_side` (the largest width or height asked for, default 1024), `vae_slicing` (default
true: the VAE decodes a batch's images one at a time; false: together). CLIP text
encoders read the first 77 tokens of a prompt.

Decoding is a batch's largest working memory: four 256x256 images decoded together held
900 MiB over the weights of an SD-1.5-shaped pipeline, one at a time 355 MiB, in the same
time (float32 on a CPU: bench/diagnostics/handler_memory.py); and an image decoded alone
does not depend on its batch-mates there either.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import DiffusionPipeline

from omni.instance.handler import (
    Answers,
    Handler,
    HandlerError,
    TensorSpec,
    each,
    gpu_done,
    gpu_step,
    module_tensors,
    together,
)

from .model_config import read_model_config
from .tensors import single_text

SIDE_STEP = 8  # Stable Diffusion's latents are an eighth of the image's side
DEFAULT_STEPS = 30
DEFAULT_GUIDANCE = 7.5
DEFAULT_MAX_SIDE = 1024


@dataclass(frozen=True)
class Job:
    """One request, checked: what to draw, at which size, from which seed."""

    prompt: str
    width: int
    height: int
    seed: int


def one_int(request: dict[str, np.ndarray], name: str) -> int:
    return int(request[name].reshape(-1)[0])


def own_side(pipe: DiffusionPipeline) -> int:
    """The side in pixels the pipeline draws by default: its denoiser's latent side (a
    UNet's, or a transformer's for SD3 and kin) times the VAE's scale."""
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    latent = getattr(pipe, "default_sample_size", None) or denoiser.config.sample_size
    return int(latent * pipe.vae_scale_factor)


def between_steps(pipe, step: int, timestep, tensors: dict) -> dict:
    """diffusers' step callback: each step's end is a point to yield the GPU at."""
    gpu_step()
    return tensors


def png(pixels: np.ndarray) -> dict[str, np.ndarray]:
    """One image's output: its [H, W, 3] pixels in [0, 1] as a PNG file, rounded to 8 bits
    as diffusers' own PIL output is."""
    (image,) = DiffusionPipeline.numpy_to_pil(pixels[None])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    out = np.empty(1, dtype=object)
    out[0] = buffer.getvalue()
    return {"image": out}


class TextToImage(Handler):
    inputs = (
        TensorSpec("prompt", "BYTES", (1,)),
        TensorSpec("width", "INT32", (1,)),
        TensorSpec("height", "INT32", (1,)),
        TensorSpec("seed", "INT64", (1,)),
    )
    outputs = (TensorSpec("image", "BYTES", (1,)),)
    max_batch_size = 4
    max_queue_delay_ms = 10.0

    def load(self, model_dir: Path, device: str) -> None:
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        self.pipe = DiffusionPipeline.from_pretrained(model_dir, dtype=dtype).to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.device = device
        config = read_model_config(model_dir)
        self.steps = int(config.get("steps", DEFAULT_STEPS))
        self.guidance = float(config.get("guidance", DEFAULT_GUIDANCE))
        self.max_side = int(config.get("max_side", DEFAULT_MAX_SIDE))
        own = own_side(self.pipe)
        self.width = int(config.get("width", own))
        self.height = int(config.get("height", own))
        slicing = config.get("vae_slicing", True)
        if not isinstance(slicing, bool):
            raise ValueError(f"vae_slicing = {slicing!r}: expected true or false")
        vae = getattr(self.pipe, "vae", None)
        if slicing and hasattr(vae, "use_slicing"):  # (diffusers' VAEs that can)
            vae.enable_slicing()

    def infer(self, batch: list[dict[str, np.ndarray]]) -> Answers:
        jobs = each(batch, self.job)
        pixels = together(jobs, self.denoise)
        gpu_done()  # what remains is the PNG encoding, on the CPU
        return each(pixels, self.encode)

    def job(self, request: dict[str, np.ndarray]) -> Job:
        """The request's job, refused where the pipeline could not draw it."""
        prompt = single_text(request, "prompt")
        if not prompt.strip():
            raise HandlerError("prompt: empty")
        width = self.side(request, "width", self.width)
        height = self.side(request, "height", self.height)
        seed = one_int(request, "seed")
        if seed < 0:
            raise HandlerError(f"seed: {seed}, expected 0 or more")
        return Job(prompt, width, height, seed)

    def side(self, request: dict[str, np.ndarray], name: str, default: int) -> int:
        value = one_int(request, name) or default
        if not (SIDE_STEP <= value <= self.max_side and value % SIDE_STEP == 0):
            raise HandlerError(
                f"{name}: {value}, expected a multiple of {SIDE_STEP} up to {self.max_side}"
            )
        return value

    def denoise(self, jobs: list[Job]) -> list[np.ndarray]:
        """Each job's pixels ([H, W, 3] in [0, 1]): one pipeline call per size."""
        pixels: dict[int, np.ndarray] = {}
        sizes = {(job.width, job.height) for job in jobs}
        for width, height in sorted(sizes):
            group = [i for i, job in enumerate(jobs) if (job.width, job.height) == (width, height)]
            images = self.pipe(
                prompt=[jobs[i].prompt for i in group],
                width=width,
                height=height,
                num_inference_steps=self.steps,
                guidance_scale=self.guidance,
                generator=[torch.Generator().manual_seed(jobs[i].seed) for i in group],
                output_type="np",
                callback_on_step_end=between_steps,
            ).images
            pixels.update(zip(group, images, strict=True))
        return [pixels[i] for i in range(len(jobs))]

    def encode(self, pixels: np.ndarray) -> dict[str, np.ndarray]:
        """CPU work after the GPU's: the image as a PNG file."""
        return png(pixels)

    def weights(self) -> list[torch.Tensor]:
        """The pipeline's models' (text encoder, denoiser, VAE): the pipeline itself is not
        a torch module, so the default finds none."""
        return module_tensors(self.pipe.components.values()) if self.pipe is not None else []

    def unload(self) -> None:
        self.pipe = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
