//! `kvvm info`.

use std::process::ExitCode;

use clap::Args;
use kvvm::num::format_size;
use kvvm::{AllocationProperties, ShareableHandleType, VirtualMemoryBackend};
use serde_json::{json, Value};

use crate::backend;
use crate::error::CliResult;
use crate::output::{self, Out};

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

fn describe(backend: &dyn VirtualMemoryBackend) -> Value {
    let caps = backend.capabilities();
    let devices = match backend.devices() {
        Ok(devices) => devices
            .iter()
            .map(|d| {
                // The other devices this one's memory can be given access from.
                let peers: Vec<u32> = devices
                    .iter()
                    .filter(|p| p.id != d.id)
                    .filter(|p| backend.can_access_peer(d.id, p.id).unwrap_or(false))
                    .map(|p| p.id.0)
                    .collect();
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
                    "peers": peers,
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

fn print_text(out: Out<'_>, v: &Value) -> std::io::Result<()> {
    let name = v["backend"].as_str().unwrap_or("?");
    if v["available"] != Value::Bool(true) {
        return writeln!(
            out,
            "{name}: unavailable: {} ({}); fix: {}",
            v["summary"].as_str().unwrap_or("?"),
            v["code"].as_str().unwrap_or("?"),
            v["fix"].as_str().unwrap_or("?")
        );
    }
    writeln!(out, "{name}: available")?;
    let c = &v["capabilities"];
    writeln!(
        out,
        "  capabilities: unmap spans mappings: {}, POSIX-fd handles: {}, kernels: {}, set-access retries: {}",
        c["unmap_spans_mappings"], c["posix_fd_handles"], c["kernels"], c["set_access_retries"]
    )?;
    for d in v["devices"].as_array().into_iter().flatten() {
        if let Some(e) = d["error"].as_str() {
            writeln!(out, "  devices: error: {e}")?;
            continue;
        }
        let total = d["total_memory"].as_u64().unwrap_or(0);
        let free = d["free_memory"]
            .as_u64()
            .map(format_size)
            .unwrap_or_else(|| "?".into());
        let gmin = d["granularity_minimum"]
            .as_u64()
            .map(format_size)
            .unwrap_or_else(|| "?".into());
        let grec = d["granularity_recommended"]
            .as_u64()
            .map(format_size)
            .unwrap_or_else(|| "?".into());
        writeln!(
            out,
            "  device {}: {} ({}), memory {} total, {} free",
            d["id"],
            d["name"].as_str().unwrap_or("?"),
            d["driver_version"].as_str().unwrap_or("?"),
            format_size(total),
            free
        )?;
        writeln!(
            out,
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
        )?;
        let peers: Vec<String> = d["peers"]
            .as_array()
            .map(|a| a.iter().map(Value::to_string).collect())
            .unwrap_or_default();
        writeln!(
            out,
            "    peer access from: {}",
            if peers.is_empty() {
                "none".to_owned()
            } else {
                peers.join(", ")
            }
        )?;
    }
    Ok(())
}

/// Prints every backend (or the one asked for): available with its devices, or one line
/// saying why not (the driver's code and the fix; `--json` keeps the backend's whole message).
pub fn run(args: &InfoArgs, out: Out<'_>) -> CliResult<ExitCode> {
    let names: Vec<&str> = match &args.backend {
        Some(b) => {
            backend::check_name(b)?;
            vec![b.as_str()]
        }
        None => vec!["cuda", "hip", "sim", "host"],
    };
    let mut all = Vec::new();
    for name in names {
        let v = match kvvm::open_backend(name) {
            Ok(b) => describe(&*b),
            Err(kvvm::OpenError::UnknownBackend(n)) => return Err(backend::unknown_backend(&n)),
            Err(e) => {
                let u = backend::unavailable(name, &e);
                json!({
                    "backend": name,
                    "available": false,
                    "summary": u.summary,
                    "code": u.code,
                    "fix": u.fix,
                    "reason": u.detail,
                })
            }
        };
        all.push(v);
    }
    if args.json {
        output::json_line(out, &Value::Array(all))?;
    } else {
        for v in &all {
            print_text(out, v)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
