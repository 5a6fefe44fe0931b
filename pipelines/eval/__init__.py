"""The eval plane: reference bits-per-byte, lm-evaluation-harness tasks offline, registration and serving.

``load_registered(uri, tracking_uri=None)`` → (``Transformer`` in eval mode, SentencePiece processor) of a
registered model, without pyfunc (imports stay lazy: importing the package costs nothing)."""


def load_registered(uri: str, tracking_uri: str | None = None):
    from pipelines.eval.model_dir import load_registered as _load

    return _load(uri, tracking_uri)
