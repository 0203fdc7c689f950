//! `kvvm info`.

use std::process::ExitCode;

use clap::Args;
use kvvm::{AllocationProperties, ShareableHandleType, VirtualMemoryBackend};
use serde_json::{json, Value};

/// Arguments of `kvvm info`.
#[derive(Debug, Args)]
pub struct InfoArgs {
    /// Only this backend (default: cuda, hip, sim and host).
    #[arg(long)]
    backend: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn describe(backend: &dyn VirtualMemoryBackend) -> Value {
    let caps = backend.capabilities();
    let devices = match backend.devices() {
        Ok(devices) => devices
            .iter()
            .map(|d| {
                let mem = backend.memory_info(d.id).ok();
                let g = backend
                    .granularity(&AllocationProperties::device(d.id))
                    .ok();
                let g_fd = backend
                    .granularity(&AllocationProperties {
                        device: d.id,
                        handle_type: ShareableHandleType::PosixFd,
                    })
                    .ok();
                json!({
                    "id": d.id.0,
                    "name": d.name,
                    "total_memory": d.total_memory,
                    "free_memory": mem.map(|m| m.free),
                    "granularity_minimum": g.map(|g| g.minimum),
                    "granularity_recommended": g.map(|g| g.recommended),
                    "granularity_posix_fd_minimum": g_fd.map(|g| g.minimum),
                    "vmm_supported": d.vmm_supported,
                    "posix_fd_supported": d.posix_fd_supported,
                    "driver_version": d.driver_version,
                })
            })
            .collect(),
        Err(e) => vec![json!({"error": e.to_string()})],
    };
    json!({
        "backend": backend.name(),
        "available": true,
        "capabilities": {
            "unmap_spans_mappings": caps.unmap_spans_mappings,
            "posix_fd_handles": caps.posix_fd_handles,
            "kernels": caps.kernels,
            "set_access_retries": caps.set_access_retries,
            "checks_reservation_bounds": caps.checks_reservation_bounds,
        },
        "devices": devices,
    })
}

fn print_text(v: &Value) {
    let name = v["backend"].as_str().unwrap_or("?");
    if v["available"] != Value::Bool(true) {
        println!(
            "{name}: unavailable: {}",
            v["reason"].as_str().unwrap_or("?")
        );
        return;
    }
    println!("{name}: available");
    let c = &v["capabilities"];
    println!(
        "  capabilities: unmap spans mappings: {}, POSIX-fd handles: {}, kernels: {}, set-access retries: {}",
        c["unmap_spans_mappings"], c["posix_fd_handles"], c["kernels"], c["set_access_retries"]
    );
    for d in v["devices"].as_array().into_iter().flatten() {
        if let Some(e) = d["error"].as_str() {
            println!("  devices: error: {e}");
            continue;
        }
        let total = d["total_memory"].as_u64().unwrap_or(0);
        let free = d["free_memory"]
            .as_u64()
            .map(gib)
            .unwrap_or_else(|| "?".into());
        let gmin = d["granularity_minimum"]
            .as_u64()
            .map(size)
            .unwrap_or_else(|| "?".into());
        let grec = d["granularity_recommended"]
            .as_u64()
            .map(size)
            .unwrap_or_else(|| "?".into());
        println!(
            "  device {}: {} ({}), memory {} total, {} free",
            d["id"],
            d["name"].as_str().unwrap_or("?"),
            d["driver_version"].as_str().unwrap_or("?"),
            gib(total),
            free
        );
        println!(
            "    granularity: minimum {gmin}, recommended {grec}; VMM: {}; POSIX fd: {}",
            if d["vmm_supported"] == Value::Bool(true) {
                "yes"
            } else {
                "no"
            },
            if d["posix_fd_supported"] == Value::Bool(true) {
                "yes"
            } else {
                "no"
            },
        );
    }
}

/// Prints every backend (or the one asked for): available with its devices, or why not.
pub fn run(args: &InfoArgs) -> Result<ExitCode, String> {
    let names: Vec<&str> = match &args.backend {
        Some(b) => vec![b.as_str()],
        None => vec!["cuda", "hip", "sim", "host"],
    };
    let mut out = Vec::new();
    for name in names {
        let v = match kvvm::open_backend(name) {
            Ok(b) => describe(&*b),
            Err(kvvm::OpenError::UnknownBackend(n)) => {
                return Err(format!("unknown backend {n:?}"))
            }
            Err(e) => json!({"backend": name, "available": false, "reason": e.to_string()}),
        };
        out.push(v);
    }
    if args.json {
        println!("{}", Value::Array(out));
    } else {
        for v in &out {
            print_text(v);
        }
    }
    Ok(ExitCode::SUCCESS)
}
