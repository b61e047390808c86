"""A model of a fork's own, defined outside the library: `tinyblock`, a small pre-norm transformer.

Listed in `model.imports` (as this file's path or its module name), it registers with the Auto classes,
and the recipe trains, checkpoints, resumes and exports it like any transformers model. It implements
exactly the contract in docs/models.md and nothing more.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput


class TinyBlockConfig(PretrainedConfig):
    model_type = "tinyblock"

    def __init__(
        self,
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=128,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)


class TinyBlockLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.heads = config.num_attention_heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        x = x + self.out(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyBlockPreTrainedModel(PreTrainedModel):
    config_class = TinyBlockConfig
    base_model_prefix = "model"  # `model.base_model`: the chunked loss reads the final hidden states from it
    _no_split_modules = ["TinyBlockLayer"]  # the repeated block: FSDP wraps it, train.compile compiles it
    supports_gradient_checkpointing = False  # train.activation_checkpointing=true is refused at start-up
    _supports_sdpa = True
    _input_embed_layer = "embed"  # get_input_embeddings() finds it (FSDP2 and μP ask it)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)


class TinyBlockModel(TinyBlockPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(TinyBlockLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size)
        self.post_init()

    def forward(self, input_ids, position_ids=None, **kwargs):
        t = input_ids.size(1)
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand_as(input_ids)
        # Positions that restart (document masking) start a new document: attend within it only.
        doc = (position_ids == 0).cumsum(-1)
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        mask = (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]
        x = self.embed(input_ids) + self.pos(position_ids)
        for layer in self.layers:
            x = layer(x, mask)
        return BaseModelOutput(last_hidden_state=self.norm(x))


class TinyBlockForCausalLM(TinyBlockPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = TinyBlockModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):  # the chunked loss projects hidden states through it
        return self.lm_head

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        # No KV cache: generation re-reads the whole prefix each token (see prepare_inputs_for_generation).
        hidden = self.model(input_ids, position_ids=position_ids).last_hidden_state
        return CausalLMOutput(logits=self.lm_head(hidden))

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": input_ids}


AutoConfig.register("tinyblock", TinyBlockConfig)
AutoModelForCausalLM.register(TinyBlockConfig, TinyBlockForCausalLM)
