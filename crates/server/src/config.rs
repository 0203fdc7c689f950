//! How a `KvService` is set up: the device, the model, the budget, the
//! prefix cache, the server's own limits and the idle expiry of sequences.

use std::sync::Arc;
use std::time::Duration;

use kvvm::kv::{KvDtype, KvLayout};
use kvvm::{DeviceId, VirtualMemoryBackend};

use crate::limits::Limits;

/// How a `KvService` is set up.
#[derive(Clone)]
pub struct ServiceConfig {
    /// The driver backend (see [`kvvm::open_backend`]).
    pub backend: Arc<dyn VirtualMemoryBackend>,
    /// The device whose memory is served.
    pub device: DeviceId,
    /// The memory budget in bytes; `None`: the device's free memory when the service starts
    /// (unlimited if the driver cannot say).
    pub budget_bytes: Option<u64>,
    /// The model preset (see [`kvvm::kv::KvGeometry::preset`]).
    pub model: String,
    /// The KV element type.
    pub dtype: KvDtype,
    /// The physical KV layout.
    pub layout: KvLayout,
    /// The model's context limit: the largest `max_tokens` a sequence may ask for.
    pub max_tokens: u64,
    /// Most bytes of released handles kept for reuse (`None`: the manager's default).
    pub pool_cap_bytes: Option<u64>,
    /// Whether prompts sent with `token_ids` go through the prefix cache (shared prefixes
    /// found automatically and mapped read-only).
    pub prefix_cache: bool,
    /// With API keys: one prefix cache for every key (a key's prompts can hit another's
    /// prefixes) instead of one per key.
    pub shared_prefix_cache: bool,
    /// The server's limits on live sequences, reserved address space and committed bytes.
    pub limits: Limits,
    /// Sequences nobody read, grew or released for this long are released (`None`: never).
    pub idle_timeout: Option<Duration>,
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig")
            .field("backend", &self.backend.name())
            .field("device", &self.device)
            .field("budget_bytes", &self.budget_bytes)
            .field("model", &self.model)
            .field("dtype", &self.dtype)
            .field("layout", &self.layout)
            .field("max_tokens", &self.max_tokens)
            .field("pool_cap_bytes", &self.pool_cap_bytes)
            .field("prefix_cache", &self.prefix_cache)
            .field("shared_prefix_cache", &self.shared_prefix_cache)
            .field("limits", &self.limits)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

/// The default idle timeout of a sequence: 10 minutes.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

impl ServiceConfig {
    /// Defaults for `backend`: device 0, llama-3-8b in fp16, seq-major, 8192 tokens, the
    /// device's free memory as the budget, the prefix cache on (one per key), the default
    /// [`Limits`], idle sequences released after [`DEFAULT_IDLE_TIMEOUT`].
    pub fn new(backend: Arc<dyn VirtualMemoryBackend>) -> Self {
        ServiceConfig {
            backend,
            device: DeviceId(0),
            budget_bytes: None,
            model: "llama-3-8b".into(),
            dtype: KvDtype::F16,
            layout: KvLayout::SeqMajor,
            max_tokens: 8192,
            pool_cap_bytes: None,
            prefix_cache: true,
            shared_prefix_cache: false,
            limits: Limits::default(),
            idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
        }
    }
}
