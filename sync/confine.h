/*
 * confine.h — opening files below a directory without following a symlink anywhere on the way,
 * for /update_weights_from_disk (disk.c), where a client may write inside the directory.
 *
 * A name is looked at once, by the open itself: nothing is checked first and opened later, so a
 * rename or a symlink swapped in between cannot redirect the read. With openat2(2) (Linux 5.6)
 * the kernel walks the path with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV: no
 * symlink (trailing or not, dangling or not), no "..", no absolute path, no mount point crossed.
 * Where openat2 is missing or filtered (ENOSYS, or EPERM under a seccomp profile), the path is
 * walked one component at a time from the directory's descriptor, each directory opened with
 * O_DIRECTORY | O_NOFOLLOW and the last component with O_NOFOLLOW, which refuses a symlink at
 * every step the same way. Either way what was opened is then checked with fstat (a directory or
 * a regular file, as asked, on the root's device), never the name.
 */
#ifndef RS_SYNC_CONFINE_H
#define RS_SYNC_CONFINE_H

#include <stdbool.h>
#include <sys/types.h>

#include "../core/rs.h"

typedef struct rs_confine {
    int root_fd;                /* the directory everything is opened below (O_DIRECTORY), owned */
    dev_t dev;                  /* its device */
} rs_confine;

/* Opens `dir` (trusted: symlinks on its own path are followed) as the root. RS_EIO with errno's
 * text when it cannot be opened as a directory. */
int rs_confine_open(rs_confine *c, const char *dir, rs_error *err);
void rs_confine_close(rs_confine *c);

/* Opens `rel` (names separated by '/', relative, no "..") below the directory `dir_fd` (the root's
 * descriptor, or one this module opened below it): as a directory when `want_dir`, else for
 * reading (O_NONBLOCK, so a FIFO never blocks). *fd gets a new descriptor (close-on-exec) on
 * RS_OK. Otherwise:
 *   RS_ENOTFOUND      a name on the way does not exist;
 *   RS_EINVAL         refused: a symlink, "..", another device, or a non-directory on the way;
 *   RS_EUNSUPPORTED   `rel` is inside but not a regular file (or not a directory when want_dir);
 *   RS_EIO            any other failure (errno is left set: EACCES, EMFILE, ...).
 * Nothing is written to an rs_error: the caller words the answer, and must say the same for every
 * refusal (it must not tell which step refused, or why). */
int rs_confine_openat(const rs_confine *c, int dir_fd, const char *rel, bool want_dir, int *fd);

/* Tests only: true makes rs_confine_openat walk component by component as if openat2 were
 * missing, so both paths are tested on a kernel that has it. */
extern bool rs_confine_test_no_openat2;

#endif /* RS_SYNC_CONFINE_H */
