"""LLM stages of the data engine (optional, ``data.llm``): an endpoint pool with a persistent response cache
(:mod:`ordata.llm.client`), paraphrasing rendered problems with a forward-modelling check
(:mod:`ordata.llm.rewrite`) and self-distillation by rejection sampling (:mod:`ordata.llm.distill`). Every
program an endpoint writes is untrusted: it runs in the sandbox and is judged by its attested solve
(:mod:`ordata.llm.judge`)."""
