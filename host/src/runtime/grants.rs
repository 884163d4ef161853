//! Directory grants pinned at load: the handle a guest's preopen names, so
//! a grant is checked by where it resolves, never by its path again.

use std::path::{Path, PathBuf};

use crate::config;

/// A directory grant opened once, when its version is loaded (deploy,
/// start, rollback, a cluster sync). The guest is given this handle (as
/// `/proc/self/fd/N`, which opens the very directory the handle holds,
/// never walking the granted path again), so a symlink swapped after the
/// check cannot redirect the grant: there is no window between check and
/// open. Where the handle is now (its `/proc/self/fd` link) is checked
/// against the tenant's allow list (symlinks resolved) when it is opened
/// and again at every instantiation, so a granted directory moved out of
/// the allow list later is not given to new instances either. Linux only.
pub struct PinnedDir {
    dir: std::fs::File,
    granted: PathBuf,
    /// The tenant's `allow.dirs`, resolved; `None`: no allow list (a handler of no tenant).
    within: Option<Vec<PathBuf>>,
}

impl std::fmt::Debug for PinnedDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedDir")
            .field("granted", &self.granted)
            .field("fd", &std::os::fd::AsRawFd::as_raw_fd(&self.dir))
            .finish()
    }
}

/// Two pins are equal only when they are the same handle.
impl PartialEq for PinnedDir {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}
impl Eq for PinnedDir {}

impl PinnedDir {
    /// Open `granted` (following symlinks) and check where the handle landed.
    pub fn open(granted: &Path, within: Option<Vec<PathBuf>>) -> Result<Self, String> {
        let dir = std::fs::File::open(granted).map_err(|e| format!("{}: cannot be opened: {e}", granted.display()))?;
        let is_dir = dir.metadata().map(|m| m.is_dir()).unwrap_or(false);
        if !is_dir {
            return Err(format!("{}: not a directory; accepted: a directory", granted.display()));
        }
        let pin = Self {
            dir,
            granted: granted.to_owned(),
            within,
        };
        pin.location()?;
        Ok(pin)
    }

    fn fd_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&self.dir)))
    }

    /// Where the directory is now, refused when that is outside the allow list.
    pub fn location(&self) -> Result<PathBuf, String> {
        let now = std::fs::read_link(self.fd_path()).map_err(|e| {
            format!(
                "{}: cannot tell where the opened directory is: {e}",
                self.granted.display()
            )
        })?;
        if let Some(roots) = &self.within
            && !roots.iter().any(|r| config::is_within(&now, r))
        {
            return Err(format!(
                "{} resolves to {}, which is not within a directory the tenant may grant; accepted: one of {:?} \
                 (tenant.allow.dirs, symlinks resolved) or below",
                self.granted.display(),
                now.display(),
                roots
            ));
        }
        Ok(now)
    }

    /// The path that opens this very directory, after checking where it is now.
    pub fn open_path(&self) -> Result<PathBuf, String> {
        self.location()?;
        Ok(self.fd_path())
    }

    /// The path the grant named.
    pub fn granted(&self) -> &Path {
        &self.granted
    }
}
