//! The hardware profile: the figures the cost model reads ([`Profile`]), and the table of
//! its keys ([`KEYS`]) with the rule each value must satisfy, which both a parser of
//! profile files (`crate::hardware`) and [`Profile::check`] apply.
//!
//! Units are in the key names: `_us` microseconds, `_gbs` GB/s (10⁹ bytes per second),
//! `_tflops` 10¹² floating-point operations per second.

/// What a value of the profile must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// A finite number above 0.
    Positive,
    /// A finite number of at least 0.
    NonNegative,
    /// A finite number of at least 1.
    AtLeastOne,
    /// A whole number of at least 1.
    Count,
}

impl Rule {
    /// Why `v` breaks the rule, or `None` when it keeps it.
    pub fn violation(self, v: f64) -> Option<String> {
        let bad = |what: &str| Some(format!("must be {what}, got {v}"));
        if !v.is_finite() {
            return bad("a finite number");
        }
        match self {
            Rule::Positive if v <= 0.0 => bad("above 0"),
            Rule::NonNegative if v < 0.0 => bad("at least 0"),
            Rule::AtLeastOne if v < 1.0 => bad("at least 1"),
            Rule::Count if v < 1.0 || v.fract() != 0.0 || v > f64::from(u32::MAX) => {
                bad("a whole number of at least 1")
            }
            _ => None,
        }
    }

    /// The rule in words, for documentation and errors.
    pub fn describe(self) -> &'static str {
        match self {
            Rule::Positive => "a number above 0",
            Rule::NonNegative => "a number of at least 0",
            Rule::AtLeastOne => "a number of at least 1",
            Rule::Count => "a whole number of at least 1",
        }
    }
}

/// One key of a profile file.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    /// Dotted path: `compute.gemm_tflops`.
    pub path: &'static str,
    /// What its value must be.
    pub rule: Rule,
    /// Whether a profile must have it (the `network.*` keys are required together, and
    /// only when `[network]` is present).
    pub required: bool,
    /// What it means (docs/simulate.md lists these).
    pub doc: &'static str,
}

/// Every numeric key of a profile file (besides `name`, a string), in the order
/// docs/simulate.md lists them.
pub const KEYS: &[Key] = &[
    Key { path: "gpus_per_node", rule: Rule::Count, required: true,
        doc: "GPUs per node: ranks `g` and `h` share a node when `g / gpus_per_node == h / gpus_per_node`; a group within one node uses `[nvlink]`, one across nodes `[network]`" },
    Key { path: "compute.gemm_tflops", rule: Rule::Positive, required: true,
        doc: "bf16 dense GEMM rate (the bench's backward: `gemms` GEMMs of `2·d³` operations per layer)" },
    Key { path: "compute.fp32_tflops", rule: Rule::Positive, required: true,
        doc: "f32 GEMM rate (Muon's Newton–Schulz iterations)" },
    Key { path: "compute.backward_us_per_layer", rule: Rule::NonNegative, required: true,
        doc: "one layer's backward per micro-batch for a config's plan (overridden by the config's `run.backward_us_per_layer` when that is above 0)" },
    Key { path: "memory.hbm_gbs", rule: Rule::Positive, required: true,
        doc: "bytes read plus written per second by the executor's elementwise kernels (pack, unpack, fold, accumulate, a group-of-one stage's copy, the norm and clip, AdamW)" },
    Key { path: "memory.kernel_us", rule: Rule::NonNegative, required: true,
        doc: "fixed device time of every kernel the executor launches, added to its work (not of the markers that aliased nodes launch)" },
    Key { path: "sync.event_us", rule: Rule::NonNegative, required: true,
        doc: "latency from an event's record completing to a stream that waits on it going on (a cross-stream edge of the plan)" },
    Key { path: "combine.gbs", rule: Rule::Positive, required: true,
        doc: "bytes read plus written per second by the copy transport's combine kernel (alone on the GPU)" },
    Key { path: "copy_engine.peer_gbs", rule: Rule::Positive, required: true,
        doc: "bytes per second of a copy-engine copy into a peer's memory (an exchange's or gather's pieces)" },
    Key { path: "copy_engine.local_gbs", rule: Rule::Positive, required: true,
        doc: "bytes per second of a copy-engine copy within the GPU (a receive copied out of the ring)" },
    Key { path: "copy_engine.piece_us", rule: Rule::NonNegative, required: true,
        doc: "fixed cost per piece (one ring slot's copy and its flag round trip)" },
    Key { path: "copy_engine.concurrency", rule: Rule::Count, required: true,
        doc: "copy-engine transfers a GPU runs at full rate at once; more share that rate" },
    Key { path: "nvlink.base_us", rule: Rule::NonNegative, required: true,
        doc: "an NCCL collective's fixed latency" },
    Key { path: "nvlink.hop_us", rule: Rule::NonNegative, required: true,
        doc: "latency per ring step within a node" },
    Key { path: "nvlink.busbw_gbs.reduce_scatter", rule: Rule::Positive, required: true,
        doc: "NCCL bus bandwidth within a node (nccl-tests' busbw) of a reduce-scatter" },
    Key { path: "nvlink.busbw_gbs.all_reduce", rule: Rule::Positive, required: true,
        doc: "the same of an all-reduce" },
    Key { path: "nvlink.busbw_gbs.all_gather", rule: Rule::Positive, required: true,
        doc: "the same of an all-gather" },
    Key { path: "nvlink.busbw_gbs.broadcast", rule: Rule::Positive, required: true,
        doc: "the same of a broadcast (the post-step publish)" },
    Key { path: "nvlink.busbw_gbs.reduce", rule: Rule::Positive, required: true,
        doc: "the same of a reduce (owned routes)" },
    Key { path: "network.hop_us", rule: Rule::NonNegative, required: false,
        doc: "latency per ring step (or tree level) that crosses nodes" },
    Key { path: "network.nic_gbs", rule: Rule::Positive, required: false,
        doc: "bytes per second one GPU's network interface carries; a group with `k` members on each node moves at most `k · nic_gbs` across" },
    Key { path: "interference.nccl.gemm_cost", rule: Rule::NonNegative, required: true,
        doc: "seconds an NCCL collective beside the backward adds to it per second of its own work done there" },
    Key { path: "interference.nccl.stretch", rule: Rule::AtLeastOne, required: true,
        doc: "how many times longer an NCCL collective takes beside the backward than alone" },
    Key { path: "interference.combine.gemm_cost", rule: Rule::NonNegative, required: true,
        doc: "the same as `interference.nccl.gemm_cost` for the combine and every other elementwise kernel" },
    Key { path: "interference.combine.stretch", rule: Rule::AtLeastOne, required: true,
        doc: "the same as `interference.nccl.stretch` for them" },
    Key { path: "interference.copy_engine.gemm_cost", rule: Rule::NonNegative, required: true,
        doc: "the same for copy-engine transfers (their memory traffic)" },
    Key { path: "interference.copy_engine.stretch", rule: Rule::AtLeastOne, required: true,
        doc: "the same for them (copies into a peer's memory)" },
    Key { path: "interference.copy_engine.local_stretch", rule: Rule::AtLeastOne, required: true,
        doc: "the same for copies within the GPU (a receive copied out of the ring)" },
    Key { path: "host.issue_us_per_node", rule: Rule::NonNegative, required: true,
        doc: "host time to issue one node (its launch, records and waits): a node cannot start before its rank's host has issued it" },
    Key { path: "host.launch_us", rule: Rule::NonNegative, required: false,
        doc: "host time of each further device operation of a node (Muon's 29 after its first: cuBLAS calls, copies, kernels); absent: `host.issue_us_per_node`" },
];

/// Bus bandwidth by collective kind, GB/s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BusBandwidth {
    /// Reduce-scatter.
    pub reduce_scatter: f64,
    /// All-reduce.
    pub all_reduce: f64,
    /// All-gather.
    pub all_gather: f64,
    /// Broadcast.
    pub broadcast: f64,
    /// Reduce.
    pub reduce: f64,
}

/// How a kind of communication kernel and the backward's GEMMs slow each other.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Beside {
    /// Seconds added to the backward per second of the kernel's own work done beside it.
    pub gemm_cost: f64,
    /// Factor by which the kernel's duration grows beside the backward.
    pub stretch: f64,
}

/// The cross-node links.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Network {
    /// Latency per step that crosses nodes, µs.
    pub hop_us: f64,
    /// Bytes per second per GPU's network interface, GB/s.
    pub nic_gbs: f64,
}

/// A hardware profile: every figure the cost model uses (module docs; the keys and their
/// meaning are [`KEYS`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// A name for reports.
    pub name: String,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// bf16 GEMM rate, TFLOP/s.
    pub gemm_tflops: f64,
    /// f32 GEMM rate, TFLOP/s.
    pub fp32_tflops: f64,
    /// A config's backward per layer and micro-batch, µs.
    pub backward_us_per_layer: f64,
    /// Elementwise kernels' bytes read plus written per second, GB/s.
    pub hbm_gbs: f64,
    /// Least device time of a kernel, µs.
    pub kernel_us: f64,
    /// Latency of a cross-stream event wait, µs.
    pub event_us: f64,
    /// The combine's bytes read plus written per second, GB/s.
    pub combine_gbs: f64,
    /// Copy-engine copies into a peer, GB/s.
    pub ce_peer_gbs: f64,
    /// Copy-engine copies within the GPU, GB/s.
    pub ce_local_gbs: f64,
    /// Fixed cost per piece of an exchange or gather, µs.
    pub ce_piece_us: f64,
    /// Copy-engine transfers at full rate at once.
    pub ce_concurrency: u32,
    /// NCCL's fixed latency, µs.
    pub nvlink_base_us: f64,
    /// Latency per ring step within a node, µs.
    pub nvlink_hop_us: f64,
    /// Bus bandwidth within a node by collective kind.
    pub nvlink_busbw: BusBandwidth,
    /// The network, when the profile describes more than one node.
    pub network: Option<Network>,
    /// NCCL collectives beside the backward.
    pub nccl_beside: Beside,
    /// The combine and the other elementwise kernels beside the backward.
    pub combine_beside: Beside,
    /// Copy-engine transfers beside the backward.
    pub copy_beside: Beside,
    /// Stretch of copy-engine copies within the GPU beside the backward.
    pub copy_local_stretch: f64,
    /// Host time to issue a node, µs.
    pub issue_us_per_node: f64,
    /// Host time of each device operation of a node after its first, µs (`None`:
    /// [`Profile::issue_us_per_node`]); see [`Profile::launch_us`].
    pub launch_us: Option<f64>,
}

/// A profile key at fault and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{key}`: {reason}")]
pub struct ProfileError {
    /// The dotted key.
    pub key: String,
    /// What is wrong and what is allowed.
    pub reason: String,
}

impl Profile {
    /// A profile with every figure set to a neutral value (1 where a rate, 0 where a
    /// latency or cost), for tests and for building one in code.
    pub fn neutral(name: &str) -> Profile {
        let bw = BusBandwidth {
            reduce_scatter: 1.0,
            all_reduce: 1.0,
            all_gather: 1.0,
            broadcast: 1.0,
            reduce: 1.0,
        };
        let none = Beside {
            gemm_cost: 0.0,
            stretch: 1.0,
        };
        Profile {
            name: name.to_string(),
            gpus_per_node: 1,
            gemm_tflops: 1.0,
            fp32_tflops: 1.0,
            backward_us_per_layer: 0.0,
            hbm_gbs: 1.0,
            kernel_us: 0.0,
            event_us: 0.0,
            combine_gbs: 1.0,
            ce_peer_gbs: 1.0,
            ce_local_gbs: 1.0,
            ce_piece_us: 0.0,
            ce_concurrency: 1,
            nvlink_base_us: 0.0,
            nvlink_hop_us: 0.0,
            nvlink_busbw: bw,
            network: None,
            nccl_beside: none,
            combine_beside: none,
            copy_beside: none,
            copy_local_stretch: 1.0,
            issue_us_per_node: 0.0,
            launch_us: None,
        }
    }

    /// Host time of each device operation of a node after its first, µs: `host.launch_us`,
    /// or `host.issue_us_per_node` where the profile has none.
    pub fn launch_us(&self) -> f64 {
        self.launch_us.unwrap_or(self.issue_us_per_node)
    }

    /// The number field at a plain dotted path (not `gpus_per_node`,
    /// `copy_engine.concurrency` nor the `network.*` keys).
    fn field(&mut self, path: &str) -> Option<&mut f64> {
        Some(match path {
            "compute.gemm_tflops" => &mut self.gemm_tflops,
            "compute.fp32_tflops" => &mut self.fp32_tflops,
            "compute.backward_us_per_layer" => &mut self.backward_us_per_layer,
            "memory.hbm_gbs" => &mut self.hbm_gbs,
            "memory.kernel_us" => &mut self.kernel_us,
            "sync.event_us" => &mut self.event_us,
            "combine.gbs" => &mut self.combine_gbs,
            "copy_engine.peer_gbs" => &mut self.ce_peer_gbs,
            "copy_engine.local_gbs" => &mut self.ce_local_gbs,
            "copy_engine.piece_us" => &mut self.ce_piece_us,
            "nvlink.base_us" => &mut self.nvlink_base_us,
            "nvlink.hop_us" => &mut self.nvlink_hop_us,
            "nvlink.busbw_gbs.reduce_scatter" => &mut self.nvlink_busbw.reduce_scatter,
            "nvlink.busbw_gbs.all_reduce" => &mut self.nvlink_busbw.all_reduce,
            "nvlink.busbw_gbs.all_gather" => &mut self.nvlink_busbw.all_gather,
            "nvlink.busbw_gbs.broadcast" => &mut self.nvlink_busbw.broadcast,
            "nvlink.busbw_gbs.reduce" => &mut self.nvlink_busbw.reduce,
            "interference.nccl.gemm_cost" => &mut self.nccl_beside.gemm_cost,
            "interference.nccl.stretch" => &mut self.nccl_beside.stretch,
            "interference.combine.gemm_cost" => &mut self.combine_beside.gemm_cost,
            "interference.combine.stretch" => &mut self.combine_beside.stretch,
            "interference.copy_engine.gemm_cost" => &mut self.copy_beside.gemm_cost,
            "interference.copy_engine.stretch" => &mut self.copy_beside.stretch,
            "interference.copy_engine.local_stretch" => &mut self.copy_local_stretch,
            "host.issue_us_per_node" => &mut self.issue_us_per_node,
            _ => return None,
        })
    }

    /// Sets the value of a key of [`KEYS`] (a `network.*` key creates the network with
    /// neutral figures first); false for a path that is not one. The value is not
    /// checked: [`Profile::check`] does that.
    pub fn set(&mut self, path: &str, v: f64) -> bool {
        // Counts are checked whole by `check`; the cast saturates.
        match path {
            "gpus_per_node" => self.gpus_per_node = v as u32,
            "copy_engine.concurrency" => self.ce_concurrency = v as u32,
            "network.hop_us" => self.network.get_or_insert(NEUTRAL_NETWORK).hop_us = v,
            "network.nic_gbs" => self.network.get_or_insert(NEUTRAL_NETWORK).nic_gbs = v,
            "host.launch_us" => self.launch_us = Some(v),
            _ => match self.field(path) {
                Some(f) => *f = v,
                None => return false,
            },
        }
        true
    }

    /// The value of a key of [`KEYS`]; `None` for a path that is not one, and for the
    /// `network.*` keys of a profile without a network.
    pub fn get(&self, path: &str) -> Option<f64> {
        match path {
            "gpus_per_node" => Some(f64::from(self.gpus_per_node)),
            "copy_engine.concurrency" => Some(f64::from(self.ce_concurrency)),
            "network.hop_us" => self.network.map(|n| n.hop_us),
            "network.nic_gbs" => self.network.map(|n| n.nic_gbs),
            "host.launch_us" => self.launch_us,
            _ => self.clone().field(path).map(|f| *f),
        }
    }

    /// Checks every figure against its rule ([`KEYS`]) and that the name is not empty.
    pub fn check(&self) -> Result<(), ProfileError> {
        if self.name.trim().is_empty() {
            return Err(ProfileError {
                key: "name".into(),
                reason: "must not be empty".into(),
            });
        }
        for k in KEYS {
            if let Some(reason) = self.get(k.path).and_then(|v| k.rule.violation(v)) {
                return Err(ProfileError {
                    key: k.path.into(),
                    reason,
                });
            }
        }
        Ok(())
    }
}

const NEUTRAL_NETWORK: Network = Network {
    hop_us: 0.0,
    nic_gbs: 1.0,
};
