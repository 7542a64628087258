"""Model discovery against a real simulated backend on a real socket: a listing parsed into
models and adapters, a failing listing keeping the last known models, a member that is gone,
and the index a backend view answers with."""

from __future__ import annotations

from gateway.mockbackend.knobs import Knobs
from gateway.mockbackend.server import start_mock_backend
from gateway.policy.compiled import endpoint_of
from gateway.policy.model import Backend
from gateway.registry.models import ModelBook, ModelsView
from gateway.services import Services
from tests.support import free_port


def backend(port: int) -> Backend:
    return Backend.model_validate(
        {"name": "b", "endpoints": [{"address": f"127.0.0.1:{port}"}],
         "models": {"discover": True, "timeout_s": 1, "names": ["static-m"]}}
    )  # fmt: skip


async def test_a_failed_listing_keeps_the_last_known_models() -> None:
    knobs = Knobs(models=["llama"], adapters={"sql": "llama"})
    mock = await start_mock_backend(f"127.0.0.1:{free_port()}", None, knobs)
    try:
        assert mock.http_port is not None
        cfg = backend(mock.http_port)
        book = ModelBook(Services())
        view = ModelsView(book, cfg)
        view.track(endpoint_of(cfg, cfg.endpoints[0].address, 1, 0))
        box = next(iter(view.boxes.values()))
        assert view.index().serving("llama") is None  # not listed yet
        await book.read(box)
        assert box.error == "" and box.listing is not None
        assert box.listing.bases == {"llama"} and dict(box.listing.adapters) == {"sql": "llama"}
        got = view.index().serving("sql")
        assert got is not None and got.members == {cfg.endpoints[0].address}
        assert view.index().serving("static-m") is not None
        epoch = book.epoch
        mock.state.knobs.failure = "http_5xx"
        await book.read(box)
        assert box.error == "status 500"
        assert box.listing.bases == {"llama"} and book.epoch == epoch  # kept, no rebuild
        mock.state.knobs.failure = "none"
        mock.state.knobs.models = ["qwen"]
        await book.read(box)
        assert box.listing.bases == {"qwen"} and book.epoch == epoch + 1
        assert view.index().serving("llama") is None
    finally:
        await mock.close()
    await book.read(box)  # the member is gone: refused, last listing kept
    assert box.error.startswith("ConnectionRefusedError") and box.listing.bases == {"qwen"}
