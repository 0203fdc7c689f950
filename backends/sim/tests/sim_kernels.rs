//! The simulator's probe kernels: loads and stores checked against the launching device's
//! access, a fault that is `DeviceLost`, writes nothing and leaves the device usable.

use kvvm_hal::{
    Access, AccessDescriptor, AllocationProperties, DeviceId, ErrorKind, KernelProbeOp,
    VirtualMemoryBackend,
};
use kvvm_sim::{SimBackend, SimConfig, MIB};

const G: u64 = 2 * MIB;

#[test]
fn kernels_load_and_store_with_the_launching_devices_access() {
    let s = SimBackend::new(SimConfig::uniform(2, G, 64 * MIB));
    assert!(s.capabilities().kernels);
    let k = s.kernel_probe().expect("the simulator has probe kernels");
    assert!(k.faults_are_recoverable());
    let va = s.reserve(G, 0, None).unwrap();
    let h = s
        .create(G, &AllocationProperties::device(DeviceId(0)))
        .unwrap();
    s.map(va, G, h).unwrap();
    let access = [
        AccessDescriptor::read_write(DeviceId(0)),
        AccessDescriptor {
            device: DeviceId(1),
            access: Access::Read,
        },
    ];
    s.set_access(va, G, &access).unwrap();
    let bytes: Vec<u8> = (0..=255u8).collect();
    s.copy_to_device(va, &bytes).unwrap();
    let want: u64 = bytes.iter().map(|&b| u64::from(b)).sum();
    for d in [DeviceId(0), DeviceId(1)] {
        assert_eq!(k.run(d, KernelProbeOp::Load, va, 256, 0).unwrap(), want);
    }
    // The owner stores; the peer, with Read access only, faults and writes nothing.
    assert_eq!(
        k.run(DeviceId(0), KernelProbeOp::Store, va, 16, 7).unwrap(),
        0
    );
    let err = k
        .run(DeviceId(1), KernelProbeOp::Store, va, 256, 9)
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::DeviceLost, "{err}");
    let mut back = vec![0u8; 256];
    s.copy_from_device(&mut back, va).unwrap();
    assert!(back[..16].iter().all(|&b| b == 7));
    assert_eq!(&back[16..], &bytes[16..]);
    // Past the mapping is a fault too; an unknown device is refused.
    let past = k.run(DeviceId(0), KernelProbeOp::Load, va, G + 1, 0);
    assert_eq!(past.unwrap_err().kind, ErrorKind::DeviceLost);
    let nobody = k.run(DeviceId(2), KernelProbeOp::Load, va, 1, 0);
    assert_eq!(nobody.unwrap_err().kind, ErrorKind::InvalidValue);
    // The device is still usable after the faults.
    s.unmap(va, G).unwrap();
    s.release(h).unwrap();
    s.free(va, G).unwrap();
    assert!(s.ledger().is_empty());
}
