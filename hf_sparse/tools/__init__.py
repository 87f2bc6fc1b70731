"""The tools layer: what builds or judges things, never needed to run a model.

Gate distillation (:mod:`.gate_training`, :mod:`.gate_eval`), the key scorer's fitting (:mod:`.key_scorer_fit`), the
long-context adapter (its file :mod:`.adapter`, data :mod:`.long_documents`, training :mod:`.long_context`), fidelity
and quality helpers (:mod:`.eval`), the embedded default model (:mod:`.default_model`), publishing on the Hub
(:mod:`.hub`), transformers' own tests under our methods (:mod:`.peer_tests`) and the ``hf-sparse`` command
(:mod:`.cli`). These modules import the runtime (``hf_sparse.*`` outside this package); the runtime never imports
them (``tests/test_layers.py`` checks it).
"""
