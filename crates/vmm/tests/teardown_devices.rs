//! Teardown synchronizes every device that may still touch the memory: the manager's own and
//! each device given access to it, once each, and no other.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};

use kvvm_hal::{
    Access, AccessDescriptor, AllocationProperties, BackendResult, Capabilities, DeviceAddress,
    DeviceId, DeviceInfo, Granularity, MemoryInfo, PhysicalHandle, VirtualMemoryBackend,
};
use kvvm_sim::{SimBackend, SimConfig};
use kvvm_vmm::{VirtualMemory, VmmConfig};

const G: u64 = 64 << 10;

/// The simulator, recording the device of every synchronize.
struct Syncs {
    sim: Arc<SimBackend>,
    synced: Mutex<Vec<DeviceId>>,
}

impl VirtualMemoryBackend for Syncs {
    fn name(&self) -> &str {
        "syncs"
    }
    fn capabilities(&self) -> Capabilities {
        self.sim.capabilities()
    }
    fn devices(&self) -> BackendResult<Vec<DeviceInfo>> {
        self.sim.devices()
    }
    fn memory_info(&self, d: DeviceId) -> BackendResult<MemoryInfo> {
        self.sim.memory_info(d)
    }
    fn granularity(&self, p: &AllocationProperties) -> BackendResult<Granularity> {
        self.sim.granularity(p)
    }
    fn reserve(&self, s: u64, a: u64, f: Option<DeviceAddress>) -> BackendResult<DeviceAddress> {
        self.sim.reserve(s, a, f)
    }
    fn free(&self, a: DeviceAddress, s: u64) -> BackendResult<()> {
        self.sim.free(a, s)
    }
    fn create(&self, s: u64, p: &AllocationProperties) -> BackendResult<PhysicalHandle> {
        self.sim.create(s, p)
    }
    fn release(&self, h: PhysicalHandle) -> BackendResult<()> {
        self.sim.release(h)
    }
    fn map(&self, a: DeviceAddress, s: u64, h: PhysicalHandle) -> BackendResult<()> {
        self.sim.map(a, s, h)
    }
    fn set_access(&self, a: DeviceAddress, s: u64, d: &[AccessDescriptor]) -> BackendResult<()> {
        self.sim.set_access(a, s, d)
    }
    fn unmap(&self, a: DeviceAddress, s: u64) -> BackendResult<()> {
        self.sim.unmap(a, s)
    }
    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> BackendResult<bool> {
        self.sim.can_access_peer(device, peer)
    }
    fn synchronize(&self, d: DeviceId) -> BackendResult<()> {
        self.synced.lock().unwrap().push(d);
        self.sim.synchronize(d)
    }
    fn copy_to_device(&self, d: DeviceAddress, s: &[u8]) -> BackendResult<()> {
        self.sim.copy_to_device(d, s)
    }
    fn copy_from_device(&self, d: &mut [u8], s: DeviceAddress) -> BackendResult<()> {
        self.sim.copy_from_device(d, s)
    }
    fn export_posix_fd(&self, h: PhysicalHandle) -> BackendResult<std::os::fd::OwnedFd> {
        self.sim.export_posix_fd(h)
    }
    fn import_posix_fd(
        &self,
        device: DeviceId,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> BackendResult<PhysicalHandle> {
        self.sim.import_posix_fd(device, fd)
    }
}

fn synced_by_teardown(device: u32, access: Vec<AccessDescriptor>) -> Vec<DeviceId> {
    let syncs = Arc::new(Syncs {
        sim: Arc::new(SimBackend::new(SimConfig::uniform(3, G, 64 * G))),
        synced: Mutex::new(Vec::new()),
    });
    let backend: Arc<dyn VirtualMemoryBackend> = syncs.clone();
    let vm = VirtualMemory::new(
        backend,
        DeviceId(device),
        kvvm_governor::Governor::unlimited(),
        VmmConfig {
            access,
            ..VmmConfig::default()
        },
    )
    .unwrap();
    let mut r = vm.reserve(4 * G).unwrap();
    r.commit(G).unwrap();
    drop(r);
    let synced = syncs.synced.lock().unwrap().clone();
    synced
}

fn rw(d: u32) -> AccessDescriptor {
    AccessDescriptor {
        device: DeviceId(d),
        access: Access::ReadWrite,
    }
}

#[test]
fn teardown_synchronizes_the_managers_own_device() {
    assert_eq!(synced_by_teardown(1, Vec::new()), vec![DeviceId(1)]);
}

#[test]
fn teardown_synchronizes_every_device_given_access_once() {
    let access = vec![rw(1), rw(2), rw(2)];
    assert_eq!(
        synced_by_teardown(1, access),
        vec![DeviceId(1), DeviceId(2)]
    );
}

#[test]
fn a_device_listed_without_access_is_not_synchronized() {
    let access = vec![
        rw(1),
        AccessDescriptor {
            device: DeviceId(0),
            access: Access::None,
        },
        rw(2),
    ];
    assert_eq!(
        synced_by_teardown(1, access),
        vec![DeviceId(1), DeviceId(2)]
    );
}
