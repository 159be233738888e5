"""Comparing the engine with Hugging Face transformers (fp32, CPU), shared by the model tests.

Imported as a top-level module, like model_fixtures (CI's plain `pytest` puts tests/ on sys.path,
not the repository root):

- `run(sched, requests)`: add (rid, ids, params) requests to an in-process scheduler and step
  until all finish -> {rid: Req};
- `greedy(max_new, ...)`: greedy sampling params, with decode / prompt logprobs when asked;
- `hf_logprobs(hf, ids)`: HF's log-softmax at every position of one sequence;
- `check(req, prompt, hf, ...)`: a finished request's greedy tokens and logprobs (each decode
  step's, and each prompt position's when asked) against HF's forward of the whole sequence;
- `check_prompt_logprobs(req, prompt, ref, k)`: prompt logprobs alone, with their top-k and
  vLLM's rank, against HF's log-softmax `ref`;
- `hf_greedy(hf, prompt, new)`: transformers' own greedy generation of exactly `new` tokens.
"""

from __future__ import annotations

import torch

TOL = 1e-4  # fp32 on the CPU: the engine's logprobs within this of HF's


def run(sched, requests, max_steps: int = 2000) -> dict:
    """Add all, step until all finish: {rid: Req}."""
    for rid, ids, params in requests:
        sched.add_request(rid, ids, params)
    done, steps = {}, 0
    while sched.has_work:
        for r in sched.step():
            if r.finish is not None:
                done[r.rid] = r
        steps += 1
        assert steps < max_steps, "no progress"
    return done


def greedy(max_new: int, prompt_k: int | None = None, top: int | None = 3, **extra) -> dict:
    """Greedy params for `max_new` tokens (EOS ignored); `top`: decode logprobs with that many
    top logprobs (None: none); `prompt_k`: prompt logprobs with that many top ones."""
    p = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    if top is not None:
        p.update(logprobs=True, top_logprobs=top)
    if prompt_k is not None:
        p["prompt_logprobs"] = prompt_k
    return {**p, **extra}


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: HF's log-softmax at each position (position j predicts ids[j + 1])."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def check(req, prompt: list[int], hf, prompt_logprobs: bool, tol: float = TOL) -> None:
    """Every decode step's (and, asked, every prompt position's) logprobs against HF's forward
    of the whole sequence; every token the greedy one."""
    ids = list(prompt) + list(req.output_ids)
    ref = hf_logprobs(hf, ids)
    if prompt_logprobs:
        assert len(req.prompt_lps) == len(prompt) - 1
        for j, (lp, top, _) in enumerate(req.prompt_lps):
            assert abs(lp - ref[j, prompt[j + 1]].item()) < tol, ("prompt", j)
            want = ref[j].topk(len(top))
            got = torch.tensor([v for _, v in top])
            assert torch.allclose(got, want.values, atol=tol), ("prompt top", j)
    lps = req.pending_lps if req.pending_lps else req.output_lps
    assert len(lps) == len(req.output_ids)
    for step, (tok, lp) in enumerate(zip(req.output_ids, lps, strict=True)):
        row = ref[len(prompt) - 1 + step]
        assert tok == int(row.argmax()), ("greedy token", step)
        assert abs(lp[0] - row[tok].item()) < tol, ("decode", step, lp[0], row[tok].item())


def check_prompt_logprobs(req, prompt: list[int], ref: torch.Tensor, k: int,
                          tol: float = TOL) -> None:
    """A request's prompt logprobs against HF's log-softmax `ref` [len(prompt), V]: each
    position's logprob, its k top tokens and values, and its rank."""
    assert len(req.prompt_lps) == len(prompt) - 1
    for j, (lp, top, rank) in enumerate(req.prompt_lps):  # position j predicts prompt[j + 1]
        want = ref[j, prompt[j + 1]].item()
        assert abs(lp - want) < tol, (j, lp, want)
        # vLLM's rank: the tokens at least as likely (itself included; 1 = the most likely)
        assert rank == int((ref[j] >= ref[j, prompt[j + 1]]).sum()), (j, rank)
        assert len(top) == k
        ref_v, ref_i = ref[j].topk(k)
        assert [t for t, _ in top] == ref_i.tolist()
        assert torch.allclose(torch.tensor([v for _, v in top]), ref_v, atol=tol)


def hf_greedy(hf, prompt: list[int], new: int) -> list[int]:
    """transformers' generate, greedy, exactly `new` tokens after `prompt`."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), max_new_tokens=new, min_new_tokens=new,
            do_sample=False)
    return out[0, len(prompt):].tolist()
