//! Switchyard's native router core.
//!
//! * [`index`]: the prefix index (the projection of the `kv` and `workers` streams), with the
//!   exact rules of the Python specification in `tests/oracles/prefix_index.py`;
//! * [`envelope`]: KV events decoded straight from the envelope's MessagePack bytes;
//! * [`mp`]: the MessagePack reader/writer both use;
//! * [`decide`]: the kv cost of a routing candidate, the guards and the kv argmin, term for term as
//!   `tests/oracles/scoring.py` (the router's only scoring: `control_plane/router/scoring.py`);
//! * [`inflight`]: the router's in-flight accounts per worker, as `tests/oracles/ledger.py`;
//! * [`emit`]: the envelope of an event this process produces, written and signed (the router's
//!   events, produced through `rdkafka` by the `python` feature's `py_produce`);
//! * [`signing`]: a worker's signature on a kv record, checked as `schemas/signing.py` does;
//! * [`blockhash`]: vLLM's sha256 block hash, for the simulated engine's trace replay;
//! * [`tokenize`]: the hash tokenizer of string prompts, as `common/tokenizer.py`;
//! * [`ttft_fit`]: the TTFT fit's solve (ridge around a prior, costs >= 0), as
//!   `tests/oracles/ttft_solve.py` (the router's only one: `control_plane/router/ttft_fit.py`);
//! * [`calls`]: the router's HTTP calls to workers (hyper on a tokio thread of its own).
//! * [`sse`]: a worker's streamed answer read into the relay's events;
//! * [`front`]: the router's HTTP server (hyper on tokio threads of its own), which hands requests
//!   to the ASGI app in batches;
//! * [`wake`]: how both wake the caller's event loop, once per batch (a socket pair).
//!
//! The pure core has no Python in it (`cargo test` tests it as is); the `python` feature adds
//! the PyO3 bindings maturin builds into the `switchyard_native` extension module.

pub mod bitset;
pub mod blockhash;
pub mod calls;
pub mod decide;
pub mod emit;
pub mod envelope;
pub mod front;
pub mod holders;
pub mod index;
pub mod inflight;
pub mod mp;
pub mod signing;
pub mod sse;
pub mod tokenize;
pub mod ttft_fit;
pub mod wake;

#[cfg(feature = "python")]
mod py;
#[cfg(feature = "python")]
mod py_calls;
#[cfg(feature = "python")]
mod py_front;
#[cfg(feature = "python")]
mod py_produce;
#[cfg(feature = "python")]
mod py_router;
