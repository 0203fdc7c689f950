//! The suite's cases, one file per area. [`all_cases`] lists them in the order they run.

pub(crate) mod access;
pub(crate) mod aliases;
pub(crate) mod copies;
pub(crate) mod create;
pub(crate) mod devices;
pub(crate) mod export;
pub(crate) mod host_copies;
pub(crate) mod kernels;
pub(crate) mod map;
pub(crate) mod peers;
pub(crate) mod reserve;
pub(crate) mod stress;
pub(crate) mod unmap;

use crate::case::Case;

macro_rules! case {
    ($area:ident :: $f:ident, $d:expr) => {
        Case {
            name: stringify!($f),
            description: $d,
            run: $area::$f,
        }
    };
}

/// Every case of the suite, in order.
// Long: a table, one `case!` an entry (rustfmt spreads each over four lines), nothing else.
// The order is the run order and interleaves the areas (a remap after the aliases, the
// out-of-memory case after that), so cutting it by area would change the order, and cutting
// it anywhere else would only split one list in two.
pub fn all_cases() -> Vec<Case> {
    vec![
        case!(
            devices::devices_are_listed,
            "at least one device, with a name and memory"
        ),
        case!(
            devices::granularity_is_sane,
            "minimum > 0, a power of two, recommended a multiple of it"
        ),
        case!(
            devices::granularity_posix_fd,
            "exportable allocations report a granularity too"
        ),
        case!(reserve::reserve_and_free, "reserve then free a range"),
        case!(
            reserve::reserve_honours_alignment,
            "a reservation is aligned as asked"
        ),
        case!(
            reserve::reserve_fixed_address_hint,
            "a free fixed address is honoured"
        ),
        case!(
            reserve::reserve_64_tib_uses_no_memory,
            "a 64 TiB reservation takes no physical memory"
        ),
        case!(
            reserve::reserve_beyond_address_space_is_out_of_memory,
            "2^48 bytes: OutOfMemory"
        ),
        case!(
            reserve::reserve_unaligned_size_is_invalid,
            "size not a granule multiple: InvalidValue"
        ),
        case!(
            reserve::free_twice_is_invalid,
            "second free of a range: InvalidValue"
        ),
        case!(
            reserve::free_with_live_mapping_is_invalid,
            "free fails while mapped, succeeds after unmap"
        ),
        case!(create::create_and_release, "create then release a handle"),
        case!(
            create::create_unaligned_size_is_invalid,
            "create of granule+1 bytes: InvalidValue"
        ),
        case!(
            create::release_twice_is_invalid,
            "second release of a handle: InvalidValue"
        ),
        case!(
            map::map_unaligned_address_is_invalid,
            "map of a whole handle at a VA not granule-aligned: InvalidValue"
        ),
        case!(
            map::map_half_granule_not_supported,
            "map of granule/2 bytes: NotSupported"
        ),
        case!(
            map::map_part_of_handle_not_supported,
            "map of one granule of a 2-granule handle: NotSupported"
        ),
        case!(
            map::map_unreserved_address_is_invalid,
            "map of a whole handle at a VA not reserved: InvalidValue"
        ),
        case!(
            map::map_over_mapping_is_invalid,
            "map of a whole handle over a mapped VA: InvalidValue"
        ),
        case!(
            map::map_multi_granule_handle,
            "one handle of several granules maps and holds data"
        ),
        case!(
            unmap::unmap_part_of_mapping_is_invalid,
            "unmap of half a mapping: InvalidValue"
        ),
        case!(
            unmap::unmap_twice_is_not_reported,
            "unmap of a range with no mapping succeeds"
        ),
        case!(
            unmap::unmap_spanning_mappings,
            "one unmap over several adjacent mappings"
        ),
        case!(
            access::copy_before_set_access_is_invalid,
            "copy before any set access: InvalidValue, device usable"
        ),
        case!(
            access::write_read_roundtrip,
            "bytes written read back, at both ends of a granule"
        ),
        case!(
            access::set_access_spans_adjacent_mappings,
            "one set access over k mappings; copies cross them"
        ),
        case!(
            aliases::read_alias_reads_data,
            "a Read alias of a handle reads what the RW mapping wrote"
        ),
        case!(
            aliases::read_alias_refuses_writes,
            "a write through a Read alias fails; device usable"
        ),
        case!(
            aliases::read_alias_outlives_owner_mapping,
            "the alias keeps reading after the owner unmaps"
        ),
        case!(
            aliases::release_while_mapped_defers_free,
            "a released mapped handle keeps its data until unmap"
        ),
        case!(
            map::remap_keeps_data,
            "a handle unmapped and mapped elsewhere keeps its bytes"
        ),
        case!(
            create::out_of_memory_when_full_then_recovers,
            "create until OutOfMemory, then the device works"
        ),
        case!(
            access::set_access_on_unmapped_range_is_invalid,
            "set access over an unmapped range: InvalidValue"
        ),
        case!(
            access::copy_from_unmapped_is_invalid,
            "a copy from an unmapped VA: InvalidValue"
        ),
        case!(
            copies::copy_rows_strided,
            "a strided row copy on the default stream lands row by row"
        ),
        case!(
            copies::copy_rows_across_unmapped_gaps,
            "row copies whose rows lie in separate mappings, unmapped VA between them"
        ),
        case!(
            copies::copy_rows_pitch_below_width_is_invalid,
            "a row copy whose pitch is below its width: InvalidValue"
        ),
        case!(
            host_copies::host_copy_round_trip,
            "device -> pinned host -> device on the copy stream is byte-exact"
        ),
        case!(
            host_copies::host_copy_outside_buffer_is_invalid,
            "a host copy past its buffer or with an unknown buffer: InvalidValue, nothing written"
        ),
        case!(
            host_copies::host_free_and_event_destroy_twice_are_invalid,
            "a second host free or event destroy: InvalidValue"
        ),
        case!(
            host_copies::stream_waits_for_a_copy_event,
            "a stream made to wait for a copy's event sees its bytes"
        ),
        case!(
            export::export_import_posix_fd,
            "export as a POSIX fd, import, map, read"
        ),
        case!(
            access::synchronize_idle_device,
            "synchronize succeeds on an idle device"
        ),
        case!(
            stress::threads_share_backend,
            "4 threads commit, copy and release concurrently"
        ),
        case!(
            stress::many_cycles_leave_nothing,
            "2000 reserve/create/map/unmap/release/free cycles leak nothing"
        ),
        case!(
            kernels::kernel_load_through_read_alias,
            "a kernel load through a Read alias reads the data"
        ),
        case!(
            kernels::kernel_store_through_read_alias_faults,
            "a kernel store through a Read alias faults (child process)"
        ),
        case!(
            peers::peer_access_is_reported_consistently,
            "a device reaches its own memory; peer access is symmetric"
        ),
        case!(
            peers::peer_reads_through_a_shared_mapping,
            "memory given Read access from a peer device is read there"
        ),
        case!(
            peers::peer_writes_through_read_write_access,
            "a peer's kernel store through ReadWrite access is seen by the owner"
        ),
        case!(
            peers::peer_store_through_read_access_faults,
            "a peer's kernel store through Read access faults (child process)"
        ),
    ]
}
