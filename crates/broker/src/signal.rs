//! Waiting for SIGTERM or SIGINT without a signal handler: the signals are blocked in every
//! thread and one thread takes them with `sigwait`.

use std::io;
use std::mem::MaybeUninit;

fn termination_set() -> io::Result<libc::sigset_t> {
    let mut set = MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigemptyset initialises the set it is given a valid pointer to.
    if unsafe { libc::sigemptyset(set.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the set was initialised by sigemptyset above.
    let mut set = unsafe { set.assume_init() };
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: `set` is an initialised sigset_t and `sig` a valid signal number.
        if unsafe { libc::sigaddset(&mut set, sig) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(set)
}

/// Blocks SIGTERM and SIGINT in the calling thread and every thread it starts afterwards.
/// Call it before starting the broker, then [`wait_for_termination`].
pub fn block_termination_signals() -> io::Result<()> {
    let set = termination_set()?;
    // SAFETY: `set` is initialised; a null old-set pointer is allowed.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// Waits until SIGTERM or SIGINT arrives (blocked beforehand with
/// [`block_termination_signals`]) and returns its number.
pub fn wait_for_termination() -> io::Result<i32> {
    let set = termination_set()?;
    let mut sig: libc::c_int = 0;
    // SAFETY: `set` is initialised and `sig` a valid place for the signal number.
    let rc = unsafe { libc::sigwait(&set, &mut sig) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(sig)
}
