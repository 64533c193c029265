fn main() {
    dhcp::main()
}
