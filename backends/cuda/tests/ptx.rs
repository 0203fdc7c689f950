//! Assembles the probe PTX with `ptxas` when one is available (`$KVVM_PTXAS`, `ptxas` on
//! `PATH`, or `/usr/local/cuda/bin/ptxas`); prints a skip line otherwise.

use std::path::PathBuf;
use std::process::Command;

fn ptxas() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("KVVM_PTXAS").map(PathBuf::from),
        Some(PathBuf::from("ptxas")),
        Some(PathBuf::from("/usr/local/cuda/bin/ptxas")),
    ];
    candidates.into_iter().flatten().find(|p| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

#[test]
fn probe_ptx_assembles_for_sm70_and_sm90() {
    let Some(ptxas) = ptxas() else {
        println!("skipped: no ptxas (set KVVM_PTXAS)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvvm-cuda-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("probe.ptx");
    std::fs::write(&src, kvvm_cuda::PROBE_PTX.to_bytes()).unwrap();
    for arch in ["sm_70", "sm_90"] {
        let out = Command::new(&ptxas)
            .arg(format!("-arch={arch}"))
            .arg(&src)
            .arg("-o")
            .arg(dir.join(format!("probe_{arch}.cubin")))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ptxas -arch={arch} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
