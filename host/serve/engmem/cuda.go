package engmem

// openVRAM is filled in by the CUDA path.
func (o *Opener) openVRAM(s Spec) (*Region, error) {
	return nil, errorf(CodeUnsupported, "vram regions are not supported yet")
}
