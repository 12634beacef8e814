"""`examples/generate.py` on the GPU, small: prefill and compiled decode steps that append
to one paged cache generate the tokens the same model predicts with torch's attention over
each whole text."""
import importlib.util

import pytest

from helpers import REPO

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def test_generation_matches_torch_attention_over_the_whole_text():
    spec = importlib.util.spec_from_file_location("generate", REPO / "examples" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    model = generate.Model(2).cuda().to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(2)
    prompts = [torch.randint(generate.VOCAB, (n,), generator=g, device="cuda")
               for n in (1, 70, 300, 129)]
    texts, rate = generate.generate(model, prompts, 12)
    assert [len(t) for t in texts] == [13, 82, 312, 141]
    assert generate.check(model, texts, 12) == 0
    assert rate > 0
