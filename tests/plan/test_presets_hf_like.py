"""A model with a ``.model`` attribute of its own (as Hugging Face models have) is taken as it is."""

from torch import nn

from memsave_nb import presets


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.lm_head = nn.Linear(4, 2)

    def forward(self, x):
        return self.lm_head(self.model(x))


def test_presets_use_the_outer_model_names():
    model = Wrapper()
    plan = presets.head_only(model)
    plan.validate(model)  # names like "model.0", not "0"
    names = plan.trainable_parameter_names(model)
    assert names == ["lm_head.weight", "lm_head.bias"]
    for label, p in presets.presets_for(model).items():
        p.validate(model)
