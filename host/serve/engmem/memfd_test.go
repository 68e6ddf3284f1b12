package engmem

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/kvhost/kvhost/host/serve/internal/memfdtest"
)

// pattern is memfdtest's fill: byte i is i*13+1.
func pattern(off, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte((off+i)*13 + 1)
	}
	return b
}

// openFDs counts this process's descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestMemfdRegion: a memfd sealed against shrinking, named by its
// holder's /proc/<pid>/fd/<n>, is mapped; the sidecar holds a descriptor
// of it exactly while the region is open; the engine cannot truncate it
// and the mapping reads every byte meanwhile.
func TestMemfdRegion(t *testing.T) {
	m := memfdtest.New(t, 4*page, memfdtest.MFD_ALLOW_SEALING, memfdtest.F_SEAL_SHRINK)
	if fds := memfdtest.FDsOf(t, m.FD); len(fds) != 1 || fds[0] != m.FD {
		t.Fatalf("before: descriptors %v on the memfd, want [%d]", fds, m.FD)
	}
	var o Opener
	const off, length = 100, 3*page + 5
	r, err := o.Open(Spec{Addr: 0x7f0000001000, Length: length, SHM: m.SHM, Offset: off})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(r.Bytes, pattern(off, length)) {
		t.Fatal("mapping does not hold the memfd's bytes at the offset")
	}
	fds := memfdtest.FDsOf(t, m.FD)
	if len(fds) != 2 {
		t.Fatalf("while registered: descriptors %v on the memfd, want the test's %d and the sidecar's", fds, m.FD)
	}
	if n := mapsOf(t, "/memfd:"+m.Name); n != 1 {
		t.Fatalf("%d mappings of the memfd, want 1", n)
	}

	// Both ways.
	copy(r.Bytes, "sidecar")
	got := make([]byte, 7)
	if _, err := syscall.Pread(m.FD, got, off); err != nil || string(got) != "sidecar" {
		t.Fatalf("engine reads %q (%v), want the sidecar's write", got, err)
	}
	if _, err := syscall.Pwrite(m.FD, []byte("engine"), off+page); err != nil {
		t.Fatal(err)
	}
	if string(r.Bytes[page:page+6]) != "engine" {
		t.Fatalf("mapping reads %q after the engine wrote", r.Bytes[page:page+6])
	}

	// The owner cannot shrink it, not even by a byte; the mapping reads
	// every byte afterwards. Growing is harmless and allowed.
	for _, size := range []int64{0, page, 4*page - 1} {
		if err := syscall.Ftruncate(m.FD, size); err != syscall.EPERM {
			t.Fatalf("ftruncate to %d: %v, want EPERM", size, err)
		}
	}
	if err := syscall.Ftruncate(m.FD, 8*page); err != nil {
		t.Fatalf("growing: %v", err)
	}
	want := pattern(off, length)
	copy(want, "sidecar")
	copy(want[page:], "engine")
	if !bytes.Equal(r.Bytes, want) {
		t.Fatal("mapping changed after the truncate attempts")
	}

	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if fds := memfdtest.FDsOf(t, m.FD); len(fds) != 1 || fds[0] != m.FD {
		t.Fatalf("after Close: descriptors %v on the memfd, want [%d]", fds, m.FD)
	}
	if n := mapsOf(t, "/memfd:"+m.Name); n != 0 {
		t.Fatalf("%d mappings of the memfd after Close", n)
	}
}

// TestMemfdOutlivesEngine: the sidecar's descriptor keeps the memfd (and
// its mapping) whole after the engine closed it and exited.
func TestMemfdOutlivesEngine(t *testing.T) {
	m := memfdtest.New(t, 2*page, memfdtest.MFD_ALLOW_SEALING, memfdtest.F_SEAL_SHRINK|memfdtest.F_SEAL_GROW|memfdtest.F_SEAL_SEAL)
	var st syscall.Stat_t
	if err := syscall.Fstat(m.FD, &st); err != nil {
		t.Fatal(err)
	}
	var o Opener
	r, err := o.Open(Spec{Addr: 0x1000, Length: 2 * page, SHM: m.SHM})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	m.Close()
	if err := syscall.Kill(m.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	fds := memfdtest.FDsOfInode(t, st.Dev, st.Ino)
	if len(fds) != 1 {
		t.Fatalf("descriptors %v on the memfd once the engine's are gone, want the sidecar's", fds)
	}
	if !bytes.Equal(r.Bytes, pattern(0, 2*page)) {
		t.Fatal("mapping changed")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if fds := memfdtest.FDsOfInode(t, st.Dev, st.Ino); len(fds) != 0 {
		t.Fatalf("descriptors %v on the memfd after Close", fds)
	}
}

// TestMemfdRefused: every /proc/<pid>/fd/<n> the sidecar must not map,
// with the words the engine sees; none leaves a descriptor or mapping.
func TestMemfdRefused(t *testing.T) {
	good := memfdtest.New(t, 2*page, memfdtest.MFD_ALLOW_SEALING, memfdtest.F_SEAL_SHRINK)
	holder := strconv.Itoa(good.Pid)
	proc := "/proc/" + holder + "/fd/"
	self := os.Getpid()

	// A memfd of the sidecar's own process, sealed as the form wants.
	own := memfdtest.Create(t, "kvhost-test-own", 2*page, memfdtest.MFD_ALLOW_SEALING, memfdtest.F_SEAL_SHRINK)
	t.Cleanup(func() { syscall.Close(own) })
	tid := 0
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range tasks {
		if n, _ := strconv.Atoi(e.Name()); n != self && n > 0 {
			tid = n
		}
	}
	if tid == 0 {
		t.Fatal("no thread of this process other than its main one")
	}

	memfd := func(flags, seals, size int) string {
		return memfdtest.New(t, size, flags, seals).SHM
	}
	held := func(path string) string {
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		return "/proc/" + strconv.Itoa(memfdtest.Hold(t, int(f.Fd()))) + "/fd/3"
	}
	_, shmPath := newSHM(t, 2*page)
	tmpFile := filepath.Join(t.TempDir(), "kv")
	if err := os.WriteFile(tmpFile, make([]byte, 2*page), 0o600); err != nil {
		t.Fatal(err)
	}
	link := fmt.Sprintf("%s/kvhost-engmem-test-%d-proclink", shmDir, self)
	if err := os.Symlink(good.SHM, link); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(link) })
	pidMax, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		t.Fatal(err)
	}
	if n, err := strconv.Atoi(string(bytes.TrimSpace(pidMax))); err != nil || n > pidMaxLimit {
		t.Fatalf("pid_max %q", pidMax)
	}

	notMemfd := "is not a memfd sealed against shrinking (F_SEAL_SHRINK)"
	for _, tc := range []struct {
		what   string
		shm    string
		length uint64
		parts  []string
	}{
		{"self", "/proc/self/fd/" + strconv.Itoa(own), 0, []string{"sidecar itself", "/proc/self"}},
		{"thread-self", "/proc/thread-self/fd/" + strconv.Itoa(own), 0, []string{"sidecar itself", "/proc/thread-self"}},
		{"own pid", fmt.Sprintf("/proc/%d/fd/%d", self, own), 0, []string{"sidecar itself"}},
		{"own thread", fmt.Sprintf("/proc/%d/fd/%d", tid, own), 0, []string{"sidecar itself"}},
		{"pid 0", "/proc/0/fd/3", 0, []string{"\"0\" is not a process id"}},
		{"pid leading zero", "/proc/0" + holder + "/fd/3", 0, []string{"is not a process id"}},
		{"pid past the limit", "/proc/4194305/fd/3", 0, []string{"is not a process id"}},
		{"pid huge", "/proc/99999999999999999999999999/fd/3", 0, []string{"is not a process id"}},
		{"fd leading zero", proc + "03", 0, []string{"\"03\" is not a descriptor number"}},
		{"fd huge", proc + "2147483648", 0, []string{"is not a descriptor number"}},
		{"no process", "/proc/4194304/fd/3", 0, []string{"no process 4194304"}},
		{"no descriptor", proc + "99", 0, []string{"has no descriptor 99"}},
		{"pipe", proc + "0", 0, []string{notMemfd, "it is \"pipe:["}},
		{"/dev/null", proc + "1", 0, []string{notMemfd, "it is \"/dev/null\""}},
		{"shm file", held(shmPath), 0, []string{notMemfd, "it is \"" + shmPath + "\""}},
		{"regular file", held(tmpFile), 0, []string{notMemfd, "it is \"" + tmpFile + "\""}},
		{"memfd unsealed", memfd(memfdtest.MFD_ALLOW_SEALING, 0, 2*page), 0, []string{notMemfd, "its seals are 0x0"}},
		{"memfd without sealing", memfd(0, 0, 2*page), 0, []string{notMemfd, "its seals are 0x1"}},
		{"memfd sealed but not shrink", memfd(memfdtest.MFD_ALLOW_SEALING, memfdtest.F_SEAL_GROW|memfdtest.F_SEAL_SEAL, 2*page), 0,
			[]string{notMemfd, "its seals are 0x5"}},
		{"memfd sealed against writing", memfd(memfdtest.MFD_ALLOW_SEALING, memfdtest.F_SEAL_SHRINK|memfdtest.F_SEAL_WRITE, 2*page), 0,
			[]string{"sealed against writing (seals 0xa)"}},
		{"memfd sealed against future writes", memfd(memfdtest.MFD_ALLOW_SEALING, memfdtest.F_SEAL_SHRINK|memfdtest.F_SEAL_FUTURE_WRITE, 2*page), 0,
			[]string{"sealed against writing (seals 0x12)"}},
		{"memfd too short", good.SHM, 2*page + 1, []string{fmt.Sprintf("region of %d bytes at offset 0 is past the end of %s (size %d)", 2*page+1, good.SHM, 2*page)}},
		{"hugetlbfs memfd", memfd(memfdtest.MFD_ALLOW_SEALING|memfdtest.MFD_HUGETLB, memfdtest.F_SEAL_SHRINK, 0), 0,
			[]string{"hugetlbfs memfd"}},
		// Not the form: resolved as a path, as before.
		{"trailing slash", good.SHM + "/", 0, []string{"not under /dev/shm or /dev/hugepages"}},
		{"task path", "/proc/" + holder + "/task/" + holder + "/fd/3", 0, []string{"not under"}},
		{"dotdot", "/proc/" + holder + "/fd/../fd/3", 0, []string{"not under"}},
		{"named pid", "/proc/init/fd/3", 0, []string{"not under"}},
		{"no fd", "/proc/" + holder + "/fd", 0, []string{"not under"}},
		{"symlink to the form", link, 0, []string{link}},
	} {
		t.Run(tc.what, func(t *testing.T) {
			length := tc.length
			if length == 0 {
				length = page
			}
			before := openFDs(t)
			var o Opener
			r, err := o.Open(Spec{Addr: 0x10000, Length: length, SHM: tc.shm})
			if err == nil {
				r.Close()
				t.Fatal("opened")
			}
			wantCode(t, err, CodeBadRegion, tc.parts...)
			if after := openFDs(t); after != before {
				t.Fatalf("%d descriptors after the refusal, %d before", after, before)
			}
		})
	}
	if n := mapsOf(t, "/memfd:"+good.Name); n != 0 {
		t.Fatalf("%d mappings left", n)
	}
}

// TestMemfdSwappedAfterCheck: a descriptor swapped between the check of
// its link and the open (a race the engine can win) is refused by the
// checks on what was opened, which is then closed.
func TestMemfdSwappedAfterCheck(t *testing.T) {
	good := memfdtest.New(t, 2*page, memfdtest.MFD_ALLOW_SEALING, memfdtest.F_SEAL_SHRINK)
	_, shmPath := newSHM(t, 2*page)
	tmpFile := filepath.Join(t.TempDir(), "kv")
	if err := os.WriteFile(tmpFile, make([]byte, 2*page), 0o600); err != nil {
		t.Fatal(err)
	}
	defer func() { testHookBeforeMemfdOpen = nil }()
	for _, tc := range []struct {
		what, swapped string
		parts         []string
	}{
		{"device", "/dev/null", []string{"not a regular file"}},
		{"regular file", tmpFile, []string{"not a memfd (F_GET_SEALS: invalid argument)"}},
		{"shm file", shmPath, []string{"its seals are 0x1"}},
	} {
		t.Run(tc.what, func(t *testing.T) {
			testHookBeforeMemfdOpen = func(string) string { return tc.swapped }
			before := openFDs(t)
			var o Opener
			r, err := o.Open(Spec{Addr: 0x10000, Length: page, SHM: good.SHM})
			if err == nil {
				r.Close()
				t.Fatal("opened")
			}
			wantCode(t, err, CodeBadRegion, good.SHM)
			wantCode(t, err, CodeBadRegion, tc.parts...)
			if after := openFDs(t); after != before {
				t.Fatalf("%d descriptors after the refusal, %d before", after, before)
			}
		})
	}
}

func TestProcFDName(t *testing.T) {
	for _, tc := range []struct {
		name    string
		pid, fd int
		ok      bool
		refused bool
	}{
		{"/proc/1/fd/0", 1, 0, true, false},
		{"/proc/4194304/fd/2147483647", 4194304, 1<<31 - 1, true, false},
		{"/proc/12/fd/345", 12, 345, true, false},
		{"/proc/self/fd/3", 0, 0, false, true},
		{"/proc/thread-self/fd/3", 0, 0, false, true},
		{"/proc/self/fd/x", 0, 0, false, false},
		{"/proc/0/fd/1", 0, 0, false, true},
		{"/proc/1/fd/01", 0, 0, false, true},
		{"/proc/+1/fd/1", 0, 0, false, false},
		{"/proc/1/fd/-1", 0, 0, false, false},
		{"/proc/1/fd/", 0, 0, false, false},
		{"/proc//fd/1", 0, 0, false, false},
		{"proc/1/fd/1", 0, 0, false, false},
		{"//proc/1/fd/1", 0, 0, false, false},
		{"/proc/1/fd/1/", 0, 0, false, false},
		{"/proc/1/fdx/1", 0, 0, false, false},
		{"/kvhost-1", 0, 0, false, false},
		{"/dev/shm/proc/1/fd/1", 0, 0, false, false},
	} {
		pid, fd, ok, e := procFDName(tc.name)
		if pid != tc.pid || fd != tc.fd || ok != tc.ok || (e != nil) != tc.refused {
			t.Errorf("procFDName(%q) = %d, %d, %v, %v; want %d, %d, %v, refused %v", tc.name, pid, fd, ok, e, tc.pid, tc.fd, tc.ok, tc.refused)
		}
	}
}
